"""Where the log goes ([logging]): stderr or a file, rotated by size or reopened on SIGHUP,
as text lines or one JSON object per line.

Events that operators search for (a client connected or went, a login refused, a
connection refused, a message dropped) are logged with `extra=` fields: `event`, and
`client_id`, `address`, `listener`, `username`, `reason` where known. The text format
shows the message as before; the JSON format puts each field in its own key, so a log
shipper needs no parsing:

    {"ts": "2026-11-30T10:00:00.123Z", "level": "info", "logger": "wrenmq.router",
     "msg": "client c1 connected from 10.0.0.7:51234 (...)", "event": "client.connected",
     "client_id": "c1", "address": "10.0.0.7:51234", "listener": "0.0.0.0:1883"}

Writes are synchronous, on the thread that logs, as they were to stderr: the lines
the broker writes per client event are few, and per-message paths log once per
second at most.
"""

import json
import logging
import logging.handlers
import sys
import time

TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"

# What every LogRecord has: anything else on a record came from `extra=`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JSONFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ms), level, logger, msg, the record's extra
    fields, and exc (the traceback) when there is one."""

    def format(self, record):
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def _handler(cfg):
    if not cfg.file:
        return logging.StreamHandler(sys.stderr)
    if cfg.max_bytes:
        return logging.handlers.RotatingFileHandler(cfg.file, maxBytes=cfg.max_bytes,
                                                    backupCount=cfg.backup_count, encoding="utf-8")
    return logging.FileHandler(cfg.file, encoding="utf-8")


def setup_logging(cfg):
    """Install the root handler [logging] asks for; returns it (reopen() takes it).
    OSError if the file cannot be opened."""
    handler = _handler(cfg)
    handler.setFormatter(JSONFormatter() if cfg.format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, cfg.level.upper()))
    return handler


def reopen(handler):
    """Close the log file so that the next line opens it again by name: after logrotate
    has moved it away (SIGHUP), lines go to the new file. Nothing for stderr."""
    if not isinstance(handler, logging.FileHandler):
        return
    handler.acquire()
    try:
        if handler.stream is not None:
            handler.stream.close()
            handler.stream = None
    finally:
        handler.release()
    logging.getLogger("wrenmq").info("log file %s reopened", handler.baseFilename)
