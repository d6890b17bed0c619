"""Speculative decoding on the GPU code path, run on every machine on the stand-in device (fake_gpu.py): the
verify steps, acceptance and rejection, and the recent window's save and restore keep every tensor on the
device, wait for it once a step, and never replay a CUDA graph captured for one-token decode rows.

On the stand-in every sampled token is 0, so a prompt of zeros gets drafts of zeros that are accepted, and a
prompt where "5 0" was followed by other tokens gets those proposed and rejected.
"""

from __future__ import annotations

import pytest
from conftest import build_tiny_model
from fake_gpu import fake_gpu
from test_gpu_paths import _engine, _run

from fp8cache.engine.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
ACCEPTED = [0] * 20  # proposes zeros: every draft accepted
REJECTED = [5, 0, 6, 7, 8, 9, 5]  # after the first 0: "5 0" proposes 6 7 8 9, all rejected
NO_REPEATS = [5, 6, 7, 8, 9]  # no n-gram of two tokens recurs: plain decode steps


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("spec-gpu")), max_position_embeddings=1024)


def _greedy(max_tokens: int = 12, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0, **extra)


@pytest.mark.parametrize("kv_scales,window", [("static", 0), ("static", 8), ("dynamic", 8)])
def test_speculation_keeps_to_the_gpu(tiny_path, kv_scales, window):
    """Prefill, verify steps mixed with plain decodes, greedy and sampled acceptance, rejection (with the window's
    slots put back), logprobs of accepted tokens, and the rolled-back blocks, every tensor on the device."""
    with fake_gpu():
        engine = _engine(tiny_path, kv_scales=kv_scales, kv_recent_window=window, speculative_config=NGRAM,
                         max_num_seqs=4, kv_cache_memory="2MiB")
        engine.add_request("accepted", ACCEPTED, _greedy(logprobs=2))
        engine.add_request("rejected", REJECTED, _greedy())
        engine.add_request("sampled", ACCEPTED, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8,
                                                               top_p=0.9))
        engine.add_request("plain", NO_REPEATS, _greedy(max_tokens=4))
        outputs = {}
        while engine.has_unfinished_requests():
            outputs |= {out.request_id: out for out in engine.step() if out.finished}
        spec, stats = engine.speculation, engine.stats
    assert spec.num_verify_steps > 0
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # some accepted, some rejected
    assert [len(outputs[r].outputs[0].token_ids) for r in ("accepted", "rejected", "sampled", "plain")] == [12, 12, 8, 4]
    assert len(outputs["accepted"].outputs[0].logprobs) == 12
    assert stats.blocks_used == 0


def _step_syncs(engine, work, verifying: bool) -> list[int]:
    """Run the engine's requests to the end after their prefill; the host syncs of each step that verified drafts
    (verifying) or of every step (not verifying), checking that every host-to-device copy is non-blocking."""
    engine.step()  # the prefill
    syncs = []
    while engine.has_unfinished_requests():
        verifies = engine.speculation.num_verify_steps
        work.reset()
        engine.step()
        if engine.speculation.num_verify_steps > verifies or not verifying:
            syncs.append(work.syncs)
        assert all(work.h2d)
    return syncs


@pytest.mark.parametrize("kv_scales", ["static", "dynamic"])
def test_a_verify_step_waits_once(tiny_path, kv_scales):
    """A verify step waits for the device once (the drawn tokens for acceptance; a plain decode step's readback
    is a wait too, which the stand-in does not count), and every host-to-device copy it makes (its metadata, the
    window slots it saves and restores) is non-blocking: the same as a plain decode step's plus the readback.
    Sampled drafts' target probabilities and logprobs add one wait each, for all sequences of the step together."""
    with fake_gpu() as work:
        engine = _engine(tiny_path, kv_scales=kv_scales, kv_recent_window=8, speculative_config=NGRAM,
                         max_num_seqs=4, kv_cache_memory="2MiB")
        engine.add_request("plain", NO_REPEATS, _greedy(max_tokens=4))
        plain = _step_syncs(engine, work, verifying=False)
        assert engine.speculation.num_verify_steps == 0
        engine.add_request("accepted", ACCEPTED, _greedy())
        engine.add_request("rejected", REJECTED, _greedy())
        greedy = _step_syncs(engine, work, verifying=True)
        for n in range(2):
            engine.add_request(f"sampled-{n}", ACCEPTED, SamplingParams(max_tokens=8, ignore_eos=True, temperature=1,
                                                                        logprobs=1))
        engine.add_request("logprobs", ACCEPTED, _greedy(logprobs=2))
        sampled = _step_syncs(engine, work, verifying=True)
    assert len(greedy) >= 2 and len(sampled) >= 2
    assert max(greedy) <= max(plain) + 1
    assert max(sampled) <= max(plain) + 3


def test_verify_steps_do_not_replay_decode_graphs(tiny_path):
    """The decode CUDA graphs are captured for one-token rows; a verify step (1 + K tokens a sequence) runs eagerly.
    On the stand-in the graphs are replaced by a recorder that declines every step (so each runs eagerly)."""
    offered = []

    class DeclineAll:
        def run(self, batch, prev_tokens=None):
            offered.append(batch.num_draft_tokens)

    with fake_gpu():
        engine = _engine(tiny_path, kv_recent_window=8, speculative_config=NGRAM, max_num_seqs=4,
                         kv_cache_memory="2MiB")
        engine.runner._graphs = DeclineAll()
        engine.runner.saturation = None  # a step counting saturation runs eagerly anyway
        engine.add_request("accepted", ACCEPTED, _greedy())
        engine.add_request("plain", NO_REPEATS, _greedy())
        _run(engine)
        assert engine.speculation.num_verify_steps > 0
    assert offered and not any(offered)
