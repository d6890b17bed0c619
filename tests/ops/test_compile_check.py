"""The GPU sources compile: CUDA kernels for sm_80 and sm_90, the CUDA torch bindings, the kernels as HIP for
gfx90a/gfx940, and the kernels as torch's hipify rewrites them for a ROCm build.

Nothing is run on a GPU (there is none here); scripts/compile_check.sh does the compiling and prints the
commands it ran. A target is skipped, with the script's reason, only when its compiler (or, for the
bindings, a CUDA torch wheel to take headers from; for hipify, torch) is missing. Each takes about a minute.
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import compile_ahead
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compile_check.sh"
SKIPPED = 77


TARGETS = ["cuda-kernels", "cuda-bindings", "hip-kernels", "hip-hipify"]  # longest first (165, 77, 75, 47 s)


def _compile(target: str) -> subprocess.CompletedProcess:
    ahead = compile_ahead.result(target, timeout=2400)  # started with the run (tests/compile_ahead.py)
    if ahead is not None:
        return subprocess.CompletedProcess([str(SCRIPT), target], ahead[0], ahead[1], "")
    return subprocess.run(["bash", str(SCRIPT), target], check=False, capture_output=True, text=True, timeout=1500)


@pytest.fixture(scope="module")
def compiles(request) -> dict[str, Future]:
    """The selected targets' compiles, started together, as many at a time as there are cores: each is one
    single-threaded compiler after another, so on 2 cores the four take ~200 s instead of ~365 s one by one.
    The targets share nothing but the unzipped CUDA torch headers, which only cuda-bindings uses."""
    wanted = {item.callspec.params.get("target") for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")}
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(wanted), len(os.sched_getaffinity(0)))))
    futures = {target: pool.submit(_compile, target) for target in TARGETS if target in wanted}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_gpu_sources_compile(target: str, compiles: dict[str, Future]) -> None:
    done = compiles[target].result()
    output = done.stdout + done.stderr
    if done.returncode == SKIPPED:
        reason = next((ln for ln in output.splitlines() if ln.startswith("SKIP")), output.strip())
        pytest.skip(reason)
    assert done.returncode == 0, f"compile check {target!r} failed:\n{output[-20000:]}"
    assert f"ok: {target}" in output


def test_unknown_target_is_refused() -> None:
    done = subprocess.run(["bash", str(SCRIPT), "metal"], check=False, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "usage:" in done.stderr
