"""When to log a prefill chunk and when to release the allocator's cached blocks: a pure state machine over
(tokens scheduled this step, MemAvailable), so the thresholds are unit-testable and countable.

- every step with >= chunk_log_tokens tokens writes a `prefill_chunk` memory line;
- between chunks: a step with >= release_tokens tokens while MemAvailable < release_below releases;
- at the end of a long prefill: the first small step after consecutive big steps totalling >= long_prefill_tokens
  releases once."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from twinspark.memory.meminfo import GIB


@dataclass
class ReleasePolicy:
    chunk_log_tokens: int = 512
    release_tokens: int = 512
    release_below: int = 24 * GIB  # MemAvailable, bytes
    long_prefill_tokens: int = 8192
    _run: int = field(default=0, repr=False)

    @classmethod
    def from_env(cls, env=os.environ) -> ReleasePolicy:
        """TWINSPARK_CHUNK_LOG_TOKENS, TWINSPARK_RELEASE_TOKENS, TWINSPARK_RELEASE_BELOW_GIB,
        TWINSPARK_LONG_PREFILL_TOKENS, each the field's default when unset. Internal: the deploy suite sets the last
        three for every rank from the recipe (twinspark.deploy.vllm_args.rank_env); the chunk-log threshold keeps
        its default there (tests lower it)."""
        d = cls()
        get = lambda k, v: type(v)(env.get(k, v))  # noqa: E731
        return cls(get("TWINSPARK_CHUNK_LOG_TOKENS", d.chunk_log_tokens),
                   get("TWINSPARK_RELEASE_TOKENS", d.release_tokens),
                   int(float(env.get("TWINSPARK_RELEASE_BELOW_GIB", d.release_below / GIB)) * GIB),
                   get("TWINSPARK_LONG_PREFILL_TOKENS", d.long_prefill_tokens))

    def step(self, tokens: int, mem_available: int) -> list[str]:
        """Actions for one scheduler step: any of 'log_chunk', 'release_between_chunks',
        'release_end_of_prefill'."""
        actions = []
        if tokens >= self.chunk_log_tokens:
            actions.append("log_chunk")
        if tokens >= self.release_tokens:
            self._run += tokens
            if mem_available < self.release_below:
                actions.append("release_between_chunks")
        else:
            if self._run >= self.long_prefill_tokens:
                actions.append("release_end_of_prefill")
            self._run = 0
        return actions
