"""Sampler: each transform against a plain one-row-at-a-time reference, draws against their distribution."""

from __future__ import annotations

import math

import pytest
import torch

from fp8cache.engine.sampler import Sampler, apply_logit_bias, apply_penalties, sampling_probs
from fp8cache.engine.sampling_params import SamplingParams
from fp8cache.engine.sequence import Sequence

VOCAB = 40


def seq_with(params: SamplingParams, prompt=(1, 2, 3), output=()) -> Sequence:
    seq = Sequence("r", 0, list(prompt), params)
    for t in output:
        seq.append_token(t)
    return seq


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def reference_probs(logits: list[float], p: SamplingParams) -> list[float]:
    """Temperature, then min-p, top-k, top-p, written out per token."""
    scaled = [x / p.temperature for x in logits]
    probs = _softmax(scaled)
    keep = set(range(len(logits)))
    if p.min_p > 0:
        keep = {i for i in keep if probs[i] >= p.min_p * max(probs)}
    if p.top_k > 0:
        keep = set(sorted(keep, key=lambda i: -scaled[i])[:p.top_k])
    if p.top_p < 1:
        kept = _softmax([scaled[i] if i in keep else -math.inf for i in range(len(logits))])
        chosen, mass = set(), 0.0
        for i in sorted(keep, key=lambda i: -kept[i]):
            chosen.add(i)
            mass += kept[i]
            if mass >= p.top_p:
                break
        keep = chosen
    return _softmax([scaled[i] if i in keep else -math.inf for i in range(len(logits))])


def _softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    es = [math.exp(x - m) if x != -math.inf else 0.0 for x in xs]
    return [e / sum(es) for e in es]


def test_greedy_is_argmax():
    logits = random_logits(6)
    seqs = [seq_with(SamplingParams(temperature=0)) for _ in range(6)]
    assert Sampler()(logits, seqs, set()) == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.15),
    SamplingParams(temperature=0.5, top_k=12, top_p=0.8, min_p=0.02),
    SamplingParams(temperature=1.0, top_k=-1, top_p=1.0),
])
def test_filtered_probabilities_match_reference(params):
    logits = random_logits(4, seed=3)
    got = sampling_probs(logits, [seq_with(params)] * 4)
    for row in range(4):
        want = torch.tensor(reference_probs(logits[row].tolist(), params))
        torch.testing.assert_close(got[row], want, atol=1e-6, rtol=1e-5)


def test_mixed_rows_in_one_batch_equal_rows_alone():
    params = [SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=2.0, min_p=0.1), SamplingParams(temperature=1.0)]
    logits = random_logits(4, seed=9)
    together = sampling_probs(logits, [seq_with(p) for p in params])
    for i, p in enumerate(params):
        torch.testing.assert_close(together[i], sampling_probs(logits[i:i + 1], [seq_with(p)])[0])


def test_penalties_match_reference():
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    prompt, output = [1, 2, 3, 3], [3, 4, 4, 4, 9]
    logits = random_logits(1, seed=5)
    expected = logits[0].tolist()
    for t in set(prompt + output):  # repetition: prompt and output, divide positives, multiply negatives
        x = expected[t]
        expected[t] = x / 1.3 if x > 0 else x * 1.3
    for t in set(output):  # presence once, frequency per occurrence: output only
        expected[t] -= 0.5 + 0.25 * output.count(t)
    got = logits.clone()
    apply_penalties(got, [seq_with(params, prompt, output)])
    torch.testing.assert_close(got[0], torch.tensor(expected))


def test_greedy_with_penalty_avoids_repeating():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 8] = 5.0, 4.9
    seq = seq_with(SamplingParams(temperature=0, repetition_penalty=1.5), prompt=[7])
    assert Sampler()(logits, [seq], set()) == [8]


def test_min_tokens_bans_eos_and_stop_tokens():
    logits = torch.zeros(2, VOCAB)
    logits[:, 0], logits[:, 5], logits[:, 6] = 9.0, 8.0, 7.0
    early = seq_with(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5]), output=[11])
    done = seq_with(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5]), output=[11, 12])
    assert Sampler()(logits, [early, done], eos_token_ids={0}) == [6, 0]


def test_seeded_requests_reproduce_regardless_of_batch():
    logits = random_logits(3, seed=1)

    def draw(batch_rows: list[int], seed_of_row0: int, steps: int = 5) -> list[int]:
        seqs = [seq_with(SamplingParams(temperature=1.0, seed=seed_of_row0 if i == 0 else None))
                for i in range(len(batch_rows))]
        sampler = Sampler(seed=len(batch_rows))  # unseeded rows use a different stream each time
        return [sampler(logits[batch_rows], seqs, set())[0] for _ in range(steps)]

    alone = draw([0], seed_of_row0=42)
    assert draw([0, 1, 2], seed_of_row0=42) == alone
    assert draw([0, 2], seed_of_row0=42) == alone
    assert draw([0], seed_of_row0=43, steps=5) != alone or draw([0], seed_of_row0=44) != alone


def test_draws_follow_the_filtered_distribution():
    base = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    params = SamplingParams(temperature=0.8, top_k=4)
    n = 20000
    seqs = [seq_with(params)] * n
    counts = torch.bincount(torch.tensor(Sampler(seed=7)(base.expand(n, -1), seqs, set())), minlength=6)
    want = torch.tensor(reference_probs(base[0].tolist(), params))
    assert counts[4:].sum() == 0, "a token outside top-k was drawn"
    assert torch.allclose(counts.float() / n, want, atol=0.015)


def test_logit_bias_is_added_before_everything_else():
    logits = random_logits(3)
    favoured, banned = int(logits[0].argmin()), int(logits[1].argmax())
    seqs = [seq_with(SamplingParams(temperature=0, logit_bias={favoured: 100})),
            seq_with(SamplingParams(temperature=0, logit_bias={banned: -100})),
            seq_with(SamplingParams(temperature=0))]
    want = logits.clone()
    want[0, favoured] += 100
    want[1, banned] -= 100
    tokens = Sampler()(logits, seqs, set())
    assert tokens == want.argmax(dim=-1).tolist() and tokens[0] == favoured and tokens[1] != banned
    # a sampled row: the bias shifts the distribution it draws from (temperature applies after it)
    p = SamplingParams(temperature=0.5, logit_bias={3: 2.0, 7: -1.5})
    row = logits[2].clone()
    row[3] += 2.0
    row[7] -= 1.5
    biased = logits[2:3].clone()
    apply_logit_bias(biased, [seq_with(p)])
    assert torch.equal(biased[0], row)
    assert sampling_probs(biased, [seq_with(p)])[0].tolist() == pytest.approx(reference_probs(row.tolist(), p))


@pytest.mark.parametrize("bias", [{-1: 1.0}, {3: 101}, {3: float("nan")}, {True: 1.0}, [3]])
def test_bad_logit_bias_is_refused(bias):
    with pytest.raises(ValueError, match="SamplingParams.logit_bias="):
        SamplingParams(logit_bias=bias)


def reference_typical(logits: list[float], mass: float) -> list[float]:
    """Locally typical sampling written out per token: rank tokens by |surprisal - entropy|, keep them in
    that order until the kept mass reaches `mass` (the token that reaches it included)."""
    probs = _softmax(logits)
    entropy = -sum(p * math.log(p) for p in probs if p > 0)
    order = sorted(range(len(logits)), key=lambda i: abs(-math.log(probs[i]) - entropy))
    keep, total = set(), 0.0
    for i in order:
        keep.add(i)
        total += probs[i]
        if total >= mass:
            break
    return _softmax([x if i in keep else -math.inf for i, x in enumerate(logits)])


@pytest.mark.parametrize("mass", [0.2, 0.6, 0.95])
def test_typical_p_keeps_the_tokens_closest_to_the_entropy(mass):
    logits = random_logits(4, seed=5)
    p = SamplingParams(temperature=1.0, typical_p=mass)
    got = sampling_probs(logits, [seq_with(p)] * 4)
    for row in range(4):
        assert got[row].tolist() == pytest.approx(reference_typical(logits[row].tolist(), mass), abs=1e-6)
    off = sampling_probs(logits, [seq_with(SamplingParams(temperature=1.0))] * 4)
    assert torch.allclose(off, logits.softmax(dim=-1))
