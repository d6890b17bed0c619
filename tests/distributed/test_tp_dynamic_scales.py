"""Dynamic KV scales over tensor parallelism: each rank keeps the scales of its own KV heads beside its share of
the cache, and two ranks give the greedy tokens of one."""

from __future__ import annotations

import pytest
from test_tp_offline import PROMPTS, greedy_tokens, quiet

from fp8cache import LLM

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")


@pytest.mark.slow
def test_two_ranks_with_dynamic_scales_give_the_greedy_tokens_of_one(tiny_llama_path):
    engine = {"model": tiny_llama_path, "kv_cache_dtype": "fp8", "kv_scales": "dynamic", "kv_recent_window": 0,
              "kv_cache_memory": "16MiB", "log": quiet}
    with LLM(tensor_parallel_size=2, **engine) as llm:
        runner = llm.engine.runner
        assert runner.num_kv_heads == 1 and [t.shape[1] for t in runner.scale_caches[0]] == [1, 1]
        got = greedy_tokens(llm, PROMPTS)
    assert greedy_tokens(LLM(**engine), PROMPTS) == got
