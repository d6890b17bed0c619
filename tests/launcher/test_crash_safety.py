"""Issue 39's kill -9 and truncation cases, a few random points each, in child processes on scratch caches
(`python tests/crash_safety.py` runs 20 points of every case; the seed is printed to rerun a failure)."""

from __future__ import annotations

import sys

import pytest
from crash_safety import run_cases

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG")


@pytest.mark.slow
def test_a_build_killed_or_cut_short_at_random_points_leaves_nothing_that_breaks_the_next_start(tmp_path):
    """Old code: the orphaned compile ran on beside the next start, whose build then died on torch's lock file
    (FileNotFoundError), and a later start loaded the orphan's library, never self-checked; a library cut short
    was a SIGBUS at every start."""
    run_cases(["ops-kill", "ops-truncate", "ops-legacy"], iterations=2, work=tmp_path, say=print)


def test_a_conversion_killed_or_cut_short_at_random_points_is_converted_whole(tmp_path):
    """Old code: a converted model.safetensors cut short was taken as converted (a SafetensorError traceback
    at every start, no reconversion)."""
    run_cases(["model-kill", "model-truncate"], iterations=2, work=tmp_path, say=print)
