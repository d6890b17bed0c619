"""Answers to "which is faster on this machine?", measured once and kept beside the op library.

Where a CPU's features do not decide between two paths (float32 linears packed or not; a bfloat16 model on a
CPU without a bfloat16 dot product), a short measurement does. Its answer is written to probes.json in the op
library's cache folder, keyed by the CPU model and features, torch's version and the question, so a start
does not pay for the measurement again and the engines of one machine do not differ by a close call.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import torch

from fp8cache.ops import _build

FILE_NAME = "probes.json"


def remembered(question: list, measure: Callable[[], bool]) -> bool:
    """The stored answer to `question` (a JSON-able list) on this machine, else measure() stored and returned.
    A missing, damaged or read-only file only means measuring again."""
    key = json.dumps([_build.cpu_identity_hash(), torch.__version__, *question])
    path = _build.cache_dir() / FILE_NAME
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if isinstance(known.get(key), bool):
        return known[key]
    answer = bool(measure())
    known[key] = answer
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f"{FILE_NAME}.{os.getpid()}")
        scratch.write_text(json.dumps(known, indent=0))
        os.replace(scratch, path)  # whole or not at all: a reader never sees half a file
    except OSError:
        pass
    return answer


def best_time(call: Callable, *args, repeats: int = 3) -> float:
    """Seconds of call(*args), best of `repeats` after one untimed call (a probe's unit of measurement)."""
    call(*args)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call(*args)
        best = min(best, time.perf_counter() - start)
    return best
