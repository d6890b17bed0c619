"""The Python API (LLM, LLMEngine) logs through `logging` under "fp8kv", to stderr, never to stdout."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
from fp8cache import LLM, SamplingParams
llm = LLM(sys.argv[1], kv_cache_dtype="fp8", kv_cache_memory="16MiB")
out = llm.generate("the city", SamplingParams(max_tokens=2))
print("tokens:", len(out[0].outputs[0].token_ids))
"""


def _run_script(model: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FP8KV_")}
    return subprocess.run([sys.executable, "-c", SCRIPT, model], capture_output=True, text=True, timeout=600,
                          cwd=REPO, env={**clean, **env}, check=False)


@pytest.mark.slow
def test_llm_keeps_stdout_for_the_program(tiny_llama_path):
    done = _run_script(tiny_llama_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "tokens: 2\n"  # only what the script printed
    # the engine's lines, named by logger, in the one format of every fp8kv log (fp8cache/platform/log.py)
    assert re.search(r"^\d\d:\d\d:\d\d INFO    fp8kv[.\w]*: KV cache:", done.stderr, re.MULTILINE), done.stderr
    assert "WARNING" in done.stderr  # "scales of 1.0" is a warning, not an info line
    quiet = _run_script(tiny_llama_path, FP8KV_CONFIGURE_LOGGING="0")  # the application's call
    assert quiet.returncode == 0 and quiet.stdout == "tokens: 2\n"
    assert "KV cache:" not in quiet.stderr


def test_llm_logs_through_the_applications_logging(tiny_llama_path, caplog, capsys):
    from fp8cache import LLM

    with caplog.at_level(logging.INFO, logger="fp8kv"):
        llm = LLM(tiny_llama_path, kv_cache_dtype="fp8", kv_cache_memory="16MiB")
        llm.close()
    lines = [r for r in caplog.records if "KV cache:" in r.getMessage()]
    assert lines and all(r.name.startswith("fp8kv") for r in lines)
    assert "KV cache:" not in capsys.readouterr().out
