"""Logging setup: plain text for people, or one JSON object per line for log pipelines."""
from __future__ import annotations

import json
import logging
import time


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
