"""Server logging: one line per finished request, as text or as JSON (one object a line)."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

request_logger = logging.getLogger("pagecast.server.requests")

# Attributes every LogRecord has; anything else was passed through ``extra``.
_STANDARD_ATTRS = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "color_message"}


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and the ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            # A record may carry a shorter message for JSON, its fields being separate keys.
            "message": getattr(record, "_json_message", None) or record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                payload[key] = value
        if record.exc_info:
            payload["exception"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def make_formatter(log_format: str) -> logging.Formatter:
    return JSONFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)


def configure_logging(log_format: str, level: int = logging.INFO) -> dict[str, Any]:
    """Route pagecast's and uvicorn's loggers through one stderr handler in ``log_format``.
    Returns the dictConfig for uvicorn (``log_config``), so it does not install its own."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(make_formatter(log_format))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "loggers": {
            # Propagate to the root handler above; no access log: the request line replaces it.
            "uvicorn": {"level": "INFO", "handlers": [], "propagate": True},
            "uvicorn.error": {"level": "INFO", "handlers": [], "propagate": True},
            "uvicorn.access": {"level": "WARNING", "handlers": [], "propagate": True},
        },
    }


def log_request(
    *,
    request_id: str,
    model: str,
    endpoint: str,
    status: int,
    prompt_tokens: int,
    completion_tokens: int,
    ttft_s: float | None,
    total_s: float,
    finish_reason: str | None,
) -> None:
    """The one line per request: text reads ``key=value`` pairs, JSON gets them as fields."""
    fields: dict[str, Any] = {
        "request_id": request_id,
        "model": model,
        "endpoint": endpoint,
        "status": status,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "ttft_s": None if ttft_s is None else round(ttft_s, 6),
        "total_s": round(total_s, 6),
        "finish_reason": finish_reason,
    }
    text = " ".join(f"{k}={'-' if v is None else v}" for k, v in fields.items())
    request_logger.info("request finished %s", text, extra={**fields, "_json_message": "request finished"})
