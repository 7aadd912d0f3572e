"""`python -m server --kv-disk`, killed with SIGKILL and started again: the returning conversation's
history comes back from disk (usage says how much), and the reply equals a recompute's."""
import signal
import subprocess

import httpx
import pytest
from openai import OpenAI

from tests.serving import start_process, wait_for

pytestmark = pytest.mark.e2e


def start_server(model: str, *flags: str) -> tuple[subprocess.Popen, str]:
    return start_process(["-m", "server", "--model", model, "--dtype", "float32", "--num-kv-blocks", "256", *flags])


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def ask(url: str, messages: list[dict]):
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)


@pytest.mark.slow
def test_kill_9_then_restart_reads_the_conversation_back(tiny_chat_model, tmp_path):
    kv = str(tmp_path / "kv")
    messages = [{"role": "system", "content": "You are the support desk of a parcel company. " * 8}]
    proc, url = start_server(tiny_chat_model, "--kv-disk", kv)
    try:
        for turn in ("Where is my parcel?", "It was due on Monday.", "Can you check again?"):
            messages.append({"role": "user", "content": turn})
            reply = ask(url, messages)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        history = reply.usage.prompt_tokens + reply.usage.completion_tokens
        wait_for(lambda: metric(url, "pagedchat:kv_disk_blocks") >= (history - 1) // 16, 60, "the blocks to be on disk")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    messages.append({"role": "user", "content": "Thanks. One more question."})
    proc, url = start_server(tiny_chat_model, "--kv-disk", kv)
    try:
        back = ask(url, messages)
        cached = back.usage.prompt_tokens_details.cached_tokens
        assert cached >= (history - 1) // 16 * 16 - 16  # the whole conversation (the chat template may
        # render the last reply's end differently from the tokens generated, costing at most a block)
        assert metric(url, "vllm:external_prefix_cache_hits_total") == cached
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    proc, url = start_server(tiny_chat_model)  # no disk tier: the same reply, recomputed
    try:
        recomputed = ask(url, messages)
        assert recomputed.usage.prompt_tokens_details is None or not recomputed.usage.prompt_tokens_details.cached_tokens
        assert recomputed.choices[0].message.content == back.choices[0].message.content
    finally:
        proc.kill()
        proc.wait(30)
