"""The commands' log: fp8cache.platform.log.configure_logging for the process a command runs in.

Only where the command owns the process's stderr: a command invoked in-process (click's CliRunner, in the tests,
or another program embedding the CLI) leaves its host's logging as it found it.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

from fp8cache.platform.log import command_log_is_set_up, configure_logging, is_terminal, progress_bars_off

if TYPE_CHECKING:
    from rich.console import Console

logger = logging.getLogger("fp8kv")


def owns_the_process() -> bool:
    """Whether this command runs as the program (its stderr the process's), not in-process inside another one
    (click's CliRunner in the tests, a program embedding the CLI), whose logging and threads are its own."""
    return sys.stderr is sys.__stderr__


def setup_logging(log_format: str = "text", libraries: bool = True, rank: int | None = None) -> None:
    """One format for every line of this command's log (see configure_logging); libraries=False for commands
    that never load a model (no transformers import); rank: a tensor-parallel rank's lines say which."""
    if owns_the_process():
        configure_logging(log_format, libraries=libraries, rank=rank)


def progress_bars_only_on_a_terminal() -> None:
    """Every command: no tqdm bars (transformers' "Loading weights", huggingface_hub's downloads) when stderr
    is a file, a pipe or journald, where each of their frames is a carriage return and more text."""
    if owns_the_process() and not is_terminal(sys.stderr):
        progress_bars_off()


def say_error(message: str, console: Console) -> None:
    """A command's error: an ERROR line of its log once it has one (run, generate, eval after their start),
    in that log's format (text or json), else `error: message` on the console (soft-wrapped: never cut at 80
    columns)."""
    if command_log_is_set_up():
        logger.error(message)
    else:
        console.print(f"[bold red]error:[/] {message}", highlight=False)
