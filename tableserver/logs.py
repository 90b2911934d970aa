"""Structured, levelled logs for the daemon and the CLI (never for library users).

Two formats, one stable shape. Text (default, for journald and humans)::

    2026-11-29T11:20:01.123Z tableserver[4242] INFO tableserver.server: SERVING tables=2 bytes=302.1MiB ...

JSON (``--log-format json``, for log pipelines): one object per line with
``ts``, ``level``, ``logger``, ``pid``, ``msg`` and every structured field.

Structured fields are passed as ``extra={"fields": {...}}`` (see :func:`kv`)
and rendered after the message as ``key=value`` in text form. Library code
only creates loggers; :func:`setup` is called by the CLI alone.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time

PREFIX = "tableserver"


def kv(**fields) -> dict:
    """``log.info(msg, extra=kv(tables=2, bytes=...))``: structured fields of one line."""
    return {"fields": fields}


def _utc(record: logging.LogRecord) -> str:
    t = time.gmtime(record.created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z"


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(32), 127)}


def escape(text: str) -> str:
    """``text`` with control characters (newlines included) shown as \\xNN: one log record, one line."""
    return text.translate(_CONTROL)


def _value(v) -> str:
    s = str(v)
    return json.dumps(s) if (not s or any(c in s for c in ' "=') or s != escape(s)) else s


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = (
            f"{_utc(record)} {PREFIX}[{record.process}] {record.levelname} {record.name}: {escape(record.getMessage())}"
        )
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={_value(v)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": _utc(record),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            doc.update(
                {k: v if isinstance(v, (int, float, bool, str)) or v is None else str(v) for k, v in fields.items()}
            )
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def setup(level: str = "info", fmt: str = "text") -> None:
    """CLI only: library code never configures the root logger."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class RateLimitedLog:
    """Logs at most one line per ``interval`` seconds per key: hot-path errors.

    A client hammering bad requests must not flood the log: the first line of
    a kind is logged, the rest of that interval counted and reported with the
    next one ("(N similar suppressed)"). The metrics count every one.
    """

    def __init__(self, logger: logging.Logger, interval: float = 5.0):
        self.logger = logger
        self.interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def log(self, level: int, key: str, msg: str, *args) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -1e9) < self.interval:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return
            self._last[key] = now
            suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            msg += f" ({suppressed} similar suppressed)"
        self.logger.log(level, msg, *args, extra=kv(throttled=key, suppressed=suppressed))

    def warning(self, key: str, msg: str, *args) -> None:
        self.log(logging.WARNING, key, msg, *args)

    def info(self, key: str, msg: str, *args) -> None:
        self.log(logging.INFO, key, msg, *args)
