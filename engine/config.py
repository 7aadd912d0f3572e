"""EngineConfig: every engine knob in one validated dataclass, with vLLM's names; the flags that set
them; and the choices made from them (device, dtype, threads, the cache folder), each made here once."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field, fields

from engine.errors import ParameterError

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = (None, "none", "int8", "int4", "int4-g64", "gguf")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
KV_CACHE_DTYPES = ("auto", "int8")  # vLLM's --kv-cache-dtype; int8: engine/kv_layout.py
DEFAULT_SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 4}'


@dataclass(frozen=True)
class Knobs:
    """Every environment variable pagedchat reads, read here and nowhere else."""
    cache: str  # PAGEDCHAT_CACHE: converted GGUF configs, the compiled C kernels, our GPTQ checkpoints
    no_kernels: bool  # PAGEDCHAT_NO_KERNELS: torch paths only (no C kernels built)
    no_packing: bool  # PAGEDCHAT_NO_PACKING: dense weights stay plain (engine/linear.py)
    no_fused_layers: bool  # PAGEDCHAT_NO_FUSED_LAYERS: the decoder layers run module by module (engine/fused_layers.py)
    cc: str  # CC: the C compiler for the kernels
    api_key: str | None  # PAGEDCHAT_API_KEY: one API key, named "api"
    api_key_file: str | None  # PAGEDCHAT_API_KEY_FILE: --api-key-file's default
    auth_file: str | None  # PAGEDCHAT_AUTH_FILE: --auth-file's default
    secret_file: str | None  # PAGEDCHAT_SECRET_FILE: --secret-file's default
    secret: str | None  # PAGEDCHAT_SECRET: signs visitor cookies
    engine_api_key: str | None  # PAGEDCHAT_ENGINE_API_KEY: the key the UI tier sends to engine pods


def knobs() -> Knobs:
    """The environment now (read on each call: cheap, and tests may set a variable)."""
    env = os.environ
    return Knobs(cache=env.get("PAGEDCHAT_CACHE") or os.path.expanduser("~/.cache/pagedchat"),
                 no_kernels=bool(env.get("PAGEDCHAT_NO_KERNELS")), no_packing=bool(env.get("PAGEDCHAT_NO_PACKING")),
                 no_fused_layers=bool(env.get("PAGEDCHAT_NO_FUSED_LAYERS")),
                 cc=env.get("CC", "cc"), api_key=env.get("PAGEDCHAT_API_KEY") or None,
                 api_key_file=env.get("PAGEDCHAT_API_KEY_FILE"), auth_file=env.get("PAGEDCHAT_AUTH_FILE"),
                 secret_file=env.get("PAGEDCHAT_SECRET_FILE"), secret=env.get("PAGEDCHAT_SECRET") or None,
                 engine_api_key=env.get("PAGEDCHAT_ENGINE_API_KEY") or None)


def cache_dir() -> str:
    """Converted GGUF configs/tokenizers, the compiled C kernel, our GPTQ checkpoints."""
    return knobs().cache


def setting(default, help: str | None = None, *, choices: tuple | None = None, flag: str | None = None,
            parse=None, metavar: str | None = None):
    """An EngineConfig field with its command-line flag: default, choices and help written once.
    `flag` overrides the flag's name (a bool defaulting to True becomes a `--no-...` switch);
    `parse` its argument type (default: int for int fields, else str)."""
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag, "parse": parse,
                                             "metavar": metavar})


@dataclass
class EngineConfig:
    model: str | None = setting(None, "HF folder, .gguf file or hub id (default: the embedded SmolLM2)")
    dtype: str = setting("auto", "auto: bf16 on CUDA and on CPUs with AVX-512 BF16 or AMX, else fp32",
                         choices=DTYPES)
    device: str = setting("auto", choices=DEVICES)
    block_size: int = setting(16, "tokens per KV block", choices=(16, 32))
    # vLLM's flag; int8: each token's K and V row of each head rounded to int8 with its own scale
    # (engine/kv_layout.py): about half the bytes a step reads and twice the sessions in the same pool
    # (a quarter and four times for fp32 models)
    kv_cache_dtype: str = setting("auto", "auto: the model's dtype; int8: K/V rounded to int8 per token and head "
                                  "(half a bf16 pool's memory, a quarter of fp32's)", choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of shared prefixes", flag="--no-prefix-caching")
    max_num_seqs: int = setting(64, "sequences in one step")
    max_model_len: int | None = setting(None, "context length (default: the model's own, capped at 8192)")
    max_num_batched_tokens: int = setting(1024, "tokens in one step (the token budget)")
    kv_cache_memory_bytes: int | None = setting(None, "KV pool size (default: a share of free memory after the "
                                                "weights)")
    num_kv_blocks: int | None = setting(None, "KV pool size in blocks (overrides --kv-cache-memory-bytes)")
    scheduling_policy: str = setting("fcfs", choices=("fcfs", "priority"))
    quantization: str | None = setting(None, "none, int8, int4, int4-g64 or gguf (default: gguf, packed "
                                       "4-bit, for GGUF files where packed kernels run, else none)")
    seed: int = setting(0)
    num_threads: int | None = setting(None, "torch and C kernel threads (default: one per available core)",
                                      flag="--threads")
    # packed linears (4-bit, the 8-bit LM head) take rows as int8 per 32 inputs (llama.cpp's Q8
    # activations; bf16 rows on AVX-512 VNNI, 1.2-1.7x the bf16 kernel at 8-64 rows; fp32 rows on AVX2,
    # engine/csrc/quant_int8_rows_f32.c); False: products in the model's dtype
    int8_activations: bool = setting(True, "packed 4-/8-bit linears multiply rows as they are, not rounded "
                                     "to int8 per 32 inputs", flag="--no-int8-activations")
    # Weights with int8 rows stream every row through the integer kernels and keep no dense copy (the
    # resident weights about the file's size); on a CPU with AMX a bf16 copy makes long prompts faster
    # (a 1500-token Q4_K_M prompt 1.94 -> 1.34 s on a Xeon) for about three times the weight memory
    dense_prompt_weights: bool = setting(False, "on a CPU with AMX, keep a bf16 copy of each packed layer for "
                                         "large prompt steps (faster long prompts, ~3x the weight memory)")
    # A row computes the same whatever shares its step (the greedy-identity invariants hold in every dtype).
    # False: where the CPU has AMX-BF16, steps of many rows take 4-bit layers through bf16 tiles from the
    # row count measured faster at load (engine/quant/choose.py), as vLLM's dense bf16 matmuls do; and rows
    # sharing a long prefix attend to it once for all (engine/cascade.py); a reply may then depend on what
    # else runs beside it. Measured: docs/benchmarks.md (AMX bf16 tiles; long system prompts).
    batch_invariant: bool = setting(True, "steps of many rows may take faster kernels whose rounding differs (AMX "
                                    "bf16 tiles for 4-bit layers, the shared-prefix cascade): a reply may then "
                                    "depend on what shares its steps", flag="--no-batch-invariant")
    max_waiting: int = setting(1024, "bounded waiting queue: past it, requests are refused as overloaded")
    # vLLM's: "raw_logprobs" are the model's log-softmax; "processed_logprobs" those of the distribution
    # sampled from: after penalties, logit_bias, masks and temperature (before top-k / top-p / min-p)
    logprobs_mode: str = setting("raw_logprobs", "raw: the model's log-softmax (vLLM's default); processed: after "
                                 "penalties, bias, masks and temperature, the distribution sampled from",
                                 choices=LOGPROBS_MODES)
    # The KV tier on disk (engine/kv_disk.py): a folder, or None for none; its size bound in bytes
    kv_disk: str | None = setting(None, "keep KV blocks that fall out of use in this folder, so returning sessions "
                                  "(also after a restart) load their history instead of recomputing it ('auto': "
                                  "the cache folder's kv/)", metavar="PATH")
    kv_disk_bytes: int = setting(4 * 2**30, "size bound of the disk tier, least recently used blocks go first "
                                 "(e.g. 4G, 512M; default 4G)", parse="size", metavar="N")
    # Prompt-lookup speculative decoding (engine/speculative.py) with vLLM's flag and keys; on by default: greedy
    # replies are the same token for token, sampled ones the same distribution, and engine/speculative.DraftPolicy
    # drafts only where the measured step cost says it pays (1-4 sessions here: 1.11-1.13x; none at 32)
    speculative_config: dict | str | None = setting(DEFAULT_SPECULATIVE, "draft tokens by prompt lookup, vLLM's "
                                                    "JSON (keys num_speculative_tokens, prompt_lookup_max, "
                                                    "prompt_lookup_min, disable_by_batch_size), or 'none'",
                                                    metavar="JSON")

    def __post_init__(self) -> None:
        def bad(name: str, msg: str) -> ValueError:
            return ParameterError(f"{name} {msg}, got {getattr(self, name)!r}.", name)

        if self.dtype not in DTYPES:
            raise bad("dtype", f"must be one of {DTYPES}")
        if self.device not in DEVICES:
            raise bad("device", f"must be one of {DEVICES}")
        if self.block_size not in (16, 32):
            raise bad("block_size", "must be 16 or 32")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting", "kv_disk_bytes"):
            if not _positive_int(getattr(self, name)):
                raise bad(name, "must be a positive integer")
        for name in ("max_model_len", "kv_cache_memory_bytes", "num_threads"):
            value = getattr(self, name)
            if value is not None and not _positive_int(value):
                raise bad(name, "must be a positive integer or None")
        if self.num_kv_blocks is not None and (not _positive_int(self.num_kv_blocks) or self.num_kv_blocks < 2):
            raise bad("num_kv_blocks", "must be an integer >= 2 or None")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise bad("scheduling_policy", "must be 'fcfs' or 'priority'")
        if self.quantization not in QUANTIZATIONS:
            raise bad("quantization", f"must be one of {QUANTIZATIONS}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise bad("logprobs_mode", f"must be one of {LOGPROBS_MODES}")
        for name in ("int8_activations", "dense_prompt_weights", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be True or False")
        if not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if self.model is not None and not (isinstance(self.model, str) and self.model):
            raise bad("model", "must be a path, a hub id or None")
        if self.kv_disk is not None and not (isinstance(self.kv_disk, str) and self.kv_disk):
            raise bad("kv_disk", "must be a folder path or None")
        from engine.speculative import ngram_settings

        ngram_settings(self.speculative_config)  # a ParameterError names what is wrong
        if self.kv_disk is not None and not self.enable_prefix_caching:
            raise bad("kv_disk", "needs prefix caching (the disk tier holds the prefix cache's blocks)")

    def resolved_threads(self) -> int:
        """Default: every core this process may run on (2 here). OMP_WAIT_POLICY=PASSIVE is set
        before torch loads (engine/__init__.py) so idle threads sleep instead of spinning."""
        return self.num_threads or len(os.sched_getaffinity(0))

    def resolved_device(self):
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available")
        return torch.device(self.device)

    def resolved_dtype(self, device):
        """auto: bf16 on CUDA (fp16 where bf16 is slow) and on CPUs with AVX512-BF16 or AMX, else fp32."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_flags() & {"avx512_bf16", "amx_bf16"} else torch.float32


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def _positive_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def add_engine_args(parser) -> None:
    """The engine's options as command-line flags (app.py and the server), made from EngineConfig's fields."""
    g = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        meta = f.metadata
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        if f.type == "bool":
            g.add_argument(flag, dest=f.name, action="store_false" if f.default else "store_true",
                           help=f"turn off: {meta['help']}" if f.default else meta["help"])
            continue
        parse = _size_flag if meta["parse"] == "size" else int if f.type.startswith("int") else None
        shown = meta["help"] or ""
        if f.default is not None and "default" not in shown:
            shown = f"{shown} (default: {f.default})".lstrip()
        g.add_argument(flag, dest=f.name, default=f.default, type=parse, choices=meta["choices"],
                       metavar=meta["metavar"], help=shown)


def parse_bytes(text: str) -> int:
    """'4G', '512M', '1.5GiB', '1000000' -> bytes (powers of 1024)."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    number, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        value = int(float(number) * units[unit])
    except ValueError:
        raise ValueError(f"not a size in bytes: {text!r} (try 4G or 512M)") from None
    if value <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return value


def _size_flag(text: str) -> int:
    import argparse

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def kv_disk_folder(setting: str | None) -> str | None:
    return os.path.join(cache_dir(), "kv") if setting == "auto" else setting


def config_from_args(args) -> EngineConfig:
    """The flags' EngineConfig; a --kv-disk folder is created (and checked writable) here, so a bad
    one stops the command at once rather than failing the model load in the background."""
    config = EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)})
    if config.kv_disk:
        folder = kv_disk_folder(config.kv_disk)
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--kv-disk {folder}: cannot create it ({e.strerror})") from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(f"--kv-disk {folder}: this process cannot write there")
    return config
