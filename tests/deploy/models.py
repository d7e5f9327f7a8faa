"""Model sources for the lab: a tiny random Llama made in-process (transformers config + a BPE tokenizer trained
with `tokenizers`), or the plugin's tiny EXL3 model once `twinspark.tiny.make_tiny` exists."""

from __future__ import annotations

import json
from pathlib import Path

# Renders thinking and the effort integer so a test can see the chat-template defaults reach the template.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if thinking %}<think effort={{ reasoning_effort }}>"
    "{% endif %}{% endif %}"
)


def make_tiny_llama(out: Path) -> Path:
    """~1 MB random Llama (head_dim 64: CPU attention supports it) with a 512-token BPE tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["What is 17*19? Reply with the integer only.", "The quick brown fox jumps over the lazy dog.",
              "system user assistant think effort 323 hello world"] * 50
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=512, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return out


def make_model(out: Path) -> Path:
    """The plugin's tiny model when available, else the tiny random Llama."""
    try:
        from twinspark.tiny import make_tiny  # lands with the vLLM plugin issue
    except ImportError:
        return make_tiny_llama(out)
    make_tiny(out)
    return out
