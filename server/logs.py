"""Logging setup: plain text for people, or one JSON object per line for log pipelines."""
from __future__ import annotations

import json
import logging
import time

request_log = logging.getLogger("pagedchat.requests")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + "Z",
                 "level": record.levelname.lower(), "logger": record.name}
        message = record.getMessage()
        try:  # request lines are already JSON objects: merge them in
            parsed = json.loads(message)
            entry.update(parsed if isinstance(parsed, dict) else {"message": message})
        except ValueError:
            entry["message"] = message
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def add_logging_args(parser) -> None:
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    parser.add_argument("--log-message-text", action="store_true",
                        help="include prompts and completions in request logs (off: never logged)")


def log_request(request_id: str | None, session: str | None, final, prompt_len: int, log_text: bool,
                prompt=None) -> None:
    """One structured line per finished request; the message text only when asked for."""
    if final is None:
        return
    out, m = final.outputs[0], final.metrics
    record = {"event": "request_finished", "request_id": request_id, "engine_request_id": final.request_id,
              "session": session, "prompt_tokens": prompt_len, "cached_tokens": final.num_cached_tokens,
              "completion_tokens": len(out.token_ids), "finish_reason": out.finish_reason,
              "ttft_s": round(m.time_to_first_token, 4) if m and m.first_token_time else None,
              "e2e_s": round((m.finished_time or m.arrival_time) - m.arrival_time, 4) if m else None}
    if log_text:
        record["prompt"] = prompt
        record["completion"] = out.text
    request_log.info(json.dumps(record))
