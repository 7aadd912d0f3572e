"""pagedchat: start the engine on the default model and chat in the terminal.

The browser UI and the OpenAI server will be composed here; until then this is a streaming
terminal chat through the engine, with the engine's flags (python app.py --help).
"""
from __future__ import annotations

import argparse
import logging
import sys

import engine  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
from engine import LLM, SamplingParams
from engine.config import add_engine_args, config_from_args

SYSTEM = "You are a helpful, concise customer service assistant."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--prompt", action="append", help="send this message and exit (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        config = config_from_args(args)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    except ValueError as e:
        parser.error(str(e))
    llm = LLM(**{k: v for k, v in config.__dict__.items()})
    messages = [{"role": "system", "content": SYSTEM}]
    inputs = iter(args.prompt) if args.prompt else _read_lines()
    for text in inputs:
        messages.append({"role": "user", "content": text})
        if args.prompt:
            print(f"you> {text}")
        reply = _stream_reply(llm, messages, params)
        messages.append({"role": "assistant", "content": reply})
    return 0


def _read_lines():
    print("pagedchat terminal chat: type a message, Ctrl-D to quit.")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return
        if line:
            yield line


def _stream_reply(llm: LLM, messages: list[dict], params: SamplingParams) -> str:
    eng = llm.engine
    rid = eng.add_request(llm.render_chat(messages), params)
    print("bot> ", end="", flush=True)
    text = ""
    while True:
        for out in eng.step():
            if out.request_id == rid:
                print(out.delta_text, end="", flush=True)
                if out.finished:
                    text = out.outputs[0].text
                    m = out.metrics
                    ttft = (m.first_token_time - m.arrival_time) if m.first_token_time else 0.0
                    n = len(out.outputs[0].token_ids)
                    secs = max(m.finished_time - m.arrival_time, 1e-9)
                    print(f"\n     [{n} tokens, {n / secs:.1f} tok/s, TTFT {ttft * 1000:.0f} ms, "
                          f"{out.num_cached_tokens} cached prompt tokens]")
                    return text


if __name__ == "__main__":
    sys.exit(main())
