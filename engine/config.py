"""EngineConfig: every engine knob in one validated dataclass, with vLLM's names; the flags that set
them; and the choices made from them (device, dtype, threads, the cache folder), each made here once."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = (None, "none", "int8", "int4", "int4-g64", "gguf")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


def cache_dir() -> str:
    """Converted GGUF configs/tokenizers, the compiled C kernel, our GPTQ checkpoints."""
    return os.environ.get("PAGEDCHAT_CACHE") or os.path.expanduser("~/.cache/pagedchat")


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's own limit, capped at 8192
    max_num_batched_tokens: int = 1024
    kv_cache_memory_bytes: int | None = None  # None: a share of free memory after the weights
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_bytes
    scheduling_policy: str = "fcfs"
    quantization: str | None = None  # None: "gguf" (packed 4-bit) for GGUF files where packed kernels run, else "none"
    seed: int = 0
    num_threads: int | None = None  # None: one per core this process may use
    # packed linears (4-bit, the 8-bit LM head) take bf16 rows as int8 per 32 inputs (llama.cpp's Q8
    # activations; AVX-512 VNNI, 1.2-1.7x the bf16 kernel at 8-64 rows); False: bf16 products
    int8_activations: bool = True
    max_waiting: int = 1024  # bounded waiting queue: past it, add_request says "overloaded"
    # vLLM's: "raw_logprobs" are the model's log-softmax; "processed_logprobs" those of the distribution
    # sampled from: after penalties, logit_bias, masks and temperature (before top-k / top-p / min-p)
    logprobs_mode: str = "raw_logprobs"
    # The KV tier on disk (engine/kv_disk.py): a folder, or None for none; its size bound in bytes
    kv_disk: str | None = None
    kv_disk_bytes: int = 4 * 2**30

    def __post_init__(self) -> None:
        def bad(name: str, msg: str) -> ValueError:
            return ValueError(f"{name} {msg}, got {getattr(self, name)!r}.")

        if self.dtype not in DTYPES:
            raise bad("dtype", f"must be one of {DTYPES}")
        if self.device not in DEVICES:
            raise bad("device", f"must be one of {DEVICES}")
        if self.block_size not in (16, 32):
            raise bad("block_size", "must be 16 or 32")
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
        if not isinstance(self.int8_activations, bool):
            raise bad("int8_activations", "must be True or False")
        if not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if self.model is not None and not (isinstance(self.model, str) and self.model):
            raise bad("model", "must be a path, a hub id or None")
        if self.kv_disk is not None and not (isinstance(self.kv_disk, str) and self.kv_disk):
            raise bad("kv_disk", "must be a folder path or None")
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
    """The engine's options as command-line flags (shared by app.py and the server)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF folder, .gguf file or hub id (default: embedded SmolLM2)")
    g.add_argument("--dtype", default="auto", choices=DTYPES)
    g.add_argument("--device", default="auto", choices=DEVICES)
    g.add_argument("--block-size", type=int, default=16, choices=(16, 32))
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "priority"))
    g.add_argument("--quantization", default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", dest="num_threads", type=int, default=None,
                   help="torch threads (default: one per available core)")
    g.add_argument("--no-int8-activations", dest="int8_activations", action="store_false",
                   help="packed 4-/8-bit linears multiply bf16 rows as they are, not rounded to int8 per 32 inputs")
    g.add_argument("--max-waiting", type=int, default=1024)
    g.add_argument("--kv-disk", default=None, metavar="PATH",
                   help="keep KV blocks that fall out of use in this folder, so returning sessions (also after a "
                        "restart) load their history instead of recomputing it ('auto': the cache folder's kv/)")
    g.add_argument("--kv-disk-bytes", type=_size_flag, default=4 * 2**30, metavar="N",
                   help="size bound of the disk tier, least recently used blocks go first (e.g. 4G, 512M; default 4G)")
    g.add_argument("--logprobs-mode", default="raw_logprobs", choices=LOGPROBS_MODES,
                   help="raw: the model's log-softmax (vLLM's default); processed: after penalties, bias, masks and "
                        "temperature, the distribution sampled from")


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
    from dataclasses import fields

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
