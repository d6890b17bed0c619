"""The library's log: loggers named under "fp8kv", written to stderr so that stdout stays the program's.

As in vLLM (whose handler writes to stdout), the first LLM() of a process that has set up no logging of its
own gets a handler on the "fp8kv" logger (INFO, to stderr, not propagated, so that a later
logging.basicConfig() does not print each line twice).
A process that configured logging first keeps its own handlers and levels; FP8KV_CONFIGURE_LOGGING=0
leaves logging alone altogether (vLLM's VLLM_CONFIGURE_LOGGING).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

ROOT = "fp8kv"
_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
_configured = False


def configure_default_logging() -> None:
    """Give the "fp8kv" logger a stderr handler, unless the application or FP8KV_CONFIGURE_LOGGING=0 says
    otherwise; idempotent."""
    global _configured
    if _configured:
        return
    _configured = True
    root = logging.getLogger(ROOT)
    if os.environ.get("FP8KV_CONFIGURE_LOGGING", "1") == "0" or root.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, "%m-%d %H:%M:%S"))
    root.addHandler(handler)
    if root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    root.propagate = False


def log_function(name: str) -> Callable[[str], None]:
    """A log(msg) callable for the engine's `log=` arguments, writing to logger `name`: lines that start
    with "warning: " at WARNING, the rest at INFO."""
    logger = logging.getLogger(name)

    def log(message: str) -> None:
        if message.startswith("warning: "):
            logger.warning(message.removeprefix("warning: "))
        else:
            logger.info(message)

    return log
