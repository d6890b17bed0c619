"""Flushing a file or folder to disk, for the caches that are written whole and renamed into place (the op
library, the converted default model): a rename only survives a crash once what it names is on disk."""

from __future__ import annotations

import os


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a folder (a folder's fsync makes the names created in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
