"""The library's log: loggers named under "fp8kv", written to stderr so that stdout stays the program's.

As in vLLM (whose handler writes to stdout), the first LLM() of a process that has set up no logging of its
own gets a handler on the "fp8kv" logger (INFO, to stderr, not propagated, so that a later
logging.basicConfig() does not print each line twice).
A process that configured logging first keeps its own handlers and levels; FP8KV_CONFIGURE_LOGGING=0
leaves logging alone altogether (vLLM's VLLM_CONFIGURE_LOGGING).

The `fp8kv` command sets up the whole process's log instead (configure_logging): one handler, one format for
every line, ours, uvicorn's, transformers' and Python's warnings alike (or one JSON object a line for journald),
no source locations, and progress bars only on a terminal: a log file or journald gets no carriage-return
frames.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import logging
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import TextIO

from fp8cache.platform import envs

ROOT = "fp8kv"
TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"
LOG_FORMATS = ("text", "json")
LOG_INTERVAL_S = 10.0
# A line already written by one of these formats (a tensor-parallel rank's, relayed by its supervisor).
LOG_LINE = re.compile(r'\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) +\S+: |\{"time": ')
_configured = False
# The loggers configure_logging routes through its one handler, their own handlers and levels dropped.
ROUTED_LOGGERS = (ROOT, "uvicorn", "uvicorn.error", "uvicorn.access", "py.warnings")
_command_handler: logging.Handler | None = None  # configure_logging's, while it is the root logger's


def configure_default_logging() -> None:
    """Give the "fp8kv" logger a stderr handler, unless the application or FP8KV_CONFIGURE_LOGGING=0 says
    otherwise; idempotent."""
    global _configured
    if _configured:
        return
    _configured = True
    root = logging.getLogger(ROOT)
    if not envs.configure_logging() or root.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TextFormatter())
    root.addHandler(handler)
    if root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    root.propagate = False


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT, `HH:MM:SS LEVEL logger: message`, on every line: a message or traceback of several lines
    repeats the head on each (indented), so that no line of the log is in another format. `rank` labels a
    tensor-parallel rank's lines: `logger: [rank 1] message`."""

    def __init__(self, rank: int | None = None) -> None:
        super().__init__(TEXT_FORMAT, DATE_FORMAT)
        self.label = f"[rank {rank}] " if rank is not None else ""

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        text = record.message
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            text += "\n" + record.exc_text
        if record.stack_info:
            text += "\n" + self.formatStack(record.stack_info)
        head = f"{self.formatTime(record, self.datefmt)} {record.levelname:<7} {record.name}: {self.label}"
        first, *rest = text.rstrip("\n").split("\n")
        return "\n".join([head + first, *(head + "  " + line for line in rest if line.strip())])


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for journald/Loki/ELK; `rank` adds a "rank" key (a tensor-parallel rank's)."""

    def __init__(self, rank: int | None = None) -> None:
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
                 "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        if self.rank is not None:
            entry["rank"] = self.rank
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class OncePerInterval(logging.Filter):
    """One record per cause (logger, level and message template) per interval; the next one let through says
    how many were dropped. A flood of bad connections then costs a line every few seconds, not 150 MB a minute.
    The access log, one line per request by design, is left alone."""

    def __init__(self, interval: float = LOG_INTERVAL_S, exempt: tuple[str, ...] = ("uvicorn.access",)) -> None:
        super().__init__()
        self.interval = interval
        self.exempt = exempt
        self._seen: dict[tuple, list] = {}  # cause -> [when last let through, dropped since]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name in self.exempt:
            return True
        key, now = (record.name, record.levelno, str(record.msg)), time.monotonic()
        with self._lock:
            entry = self._seen.get(key)
            if entry is not None and now - entry[0] < self.interval:
                entry[1] += 1
                return False
            dropped = entry[1] if entry is not None else 0
            self._seen[key] = [now, 0]
            if len(self._seen) > 4096:  # messages formatted in advance are causes of their own: forget old ones
                self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.interval}
        if dropped:
            record.msg = f"{record.msg} [and {dropped} more like this in the {self.interval:g} s before, not logged]"
        return True


def log_formatter(log_format: str = "text", rank: int | None = None) -> logging.Formatter:
    """The formatter of `text` (HH:MM:SS LEVEL logger: message) or `json` lines; a tensor-parallel rank's lines
    say which rank ("logger: [rank 1] message", or a "rank" key)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} is not known; use text or json")
    return JsonFormatter(rank) if log_format == "json" else TextFormatter(rank)


def configure_logging(log_format: str = "text", stream: TextIO | None = None, libraries: bool = True,
                      rank: int | None = None) -> None:
    """The process's log, for the `fp8kv` command: one handler on the root logger (INFO, to `stream`, stderr by
    default) in one format, `text` or `json` (log_formatter), that every line goes through: fp8kv's, uvicorn's
    (its own handlers dropped), transformers' (its handler dropped, its records propagated; libraries=False
    leaves transformers alone, for commands that never import it) and warnings.warn's. Progress bars are turned
    off unless the stream is a terminal."""
    formatter = log_formatter(log_format, rank)
    stream = sys.stderr if stream is None else stream
    handler = logging.StreamHandler(stream)
    handler.addFilter(OncePerInterval())
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    global _command_handler
    _command_handler = handler
    for name in ROUTED_LOGGERS:
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
        logging.getLogger(name).disabled = False  # a dictConfig before (uvicorn's) may have switched it off
        logging.getLogger(name).setLevel(logging.NOTSET)  # the root's INFO decides, whatever a uvicorn.Config(
        # log_level=...) made earlier in this process left (its "Started server process" line went missing)
    logging.captureWarnings(True)
    warnings.showwarning = _log_warning
    if not is_terminal(stream):
        progress_bars_off()
    if libraries:
        route_transformers_logs()


def command_log_is_set_up() -> bool:
    """Whether configure_logging's handler writes this process's log (a command's last error line then goes
    through it too, in its format)."""
    return _command_handler is not None and _command_handler in logging.getLogger().handlers


def _log_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """warnings.warn's records, in place of logging.captureWarnings' own: one line, "Category: message",
    without the file, line number and source line that warnings.formatwarning adds."""
    if file is not None:  # a caller that asked for a file gets the warning there, as without logging
        file.write(warnings.formatwarning(message, category, filename, lineno, line))
        return
    # Formatted here: each warning is its own cause for OncePerInterval, not one "%s: %s" for them all.
    logging.getLogger("py.warnings").warning(f"{category.__name__}: {message}")


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def progress_bars_off() -> None:
    """No progress bars from tqdm, transformers or huggingface_hub in this process and its children. The
    environment variables count for libraries imported later (tqdm reads its TQDM_* defaults at import);
    those imported already are told directly."""
    os.environ["TQDM_DISABLE"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "transformers.utils.logging" in sys.modules:
        sys.modules["transformers.utils.logging"].disable_progress_bar()
    if "huggingface_hub.utils" in sys.modules:
        sys.modules["huggingface_hub.utils"].disable_progress_bars()


def route_transformers_logs() -> None:
    """transformers writes through a handler of its own (plain messages, another format): drop it, so its
    records reach the root logger's handler like every other line. Without importing transformers (about a
    second, which a command that fails on its arguments should not spend): if it is not imported yet, this is
    done as its logging module is."""
    module = sys.modules.get(_TRANSFORMERS_LOGGING)
    if module is not None:
        _route_through_root(module)
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_TRANSFORMERS_LOGGING, _route_through_root))


_TRANSFORMERS_LOGGING = "transformers.utils.logging"


def _route_through_root(hf_logging) -> None:
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls then(module) when the module `name` has been executed, wherever it is imported from; removes
    itself from sys.meta_path at that import."""

    def __init__(self, name: str, then: Callable) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    def __init__(self, loader, then: Callable) -> None:
        self.loader, self.then = loader, then

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.then(module)

    def __getattr__(self, name: str):  # get_source, is_package, ...: the real loader's
        return getattr(self.loader, name)


def log_function(name: str) -> Callable[[str], None]:
    """A log(msg) callable for the engine's `log=` arguments, writing to logger `name`: lines that start
    with "warning: " at WARNING (without those words: the level says it), the rest at INFO."""
    logger = logging.getLogger(name)

    def log(message: str) -> None:
        message = message.rstrip()
        if message.startswith("warning: "):
            logger.warning(message.removeprefix("warning: "))
        else:
            logger.info(message)

    return log
