"""Log-probabilities of chosen tokens and of the most likely ones, for requests that ask for them: the
sampled tokens (SamplingParams.logprobs) and the prompt's own tokens (prompt_logprobs).

They come from the model's raw logits (vLLM's default): min_tokens bans, penalties, temperature and
top-k/p shape what is drawn, not what is reported, so a greedy and a sampled request agree on the numbers.
"""

from __future__ import annotations

import torch

from fp8cache.engine.outputs import Logprob
from fp8cache.engine.sequence import Sequence


def logprob_entries(
    logits: torch.Tensor, tokens: list[int], tops: list[int], tokenizer
) -> list[dict[int, Logprob]]:
    """One dict per row of logits: tokens[i]'s Logprob and those of the tops[i] most likely tokens."""
    if not tokens:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(tokens, device=logprobs.device).unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen)
    ranks = (logprobs > chosen_logprobs).sum(dim=1) + 1
    top_logprobs, top_ids = logprobs.topk(max(tops), dim=-1)
    chosen_logprobs, ranks = chosen_logprobs.squeeze(1).tolist(), ranks.tolist()
    top_logprobs, top_ids = top_logprobs.tolist(), top_ids.tolist()
    entries = []
    for i, (token, k) in enumerate(zip(tokens, tops)):
        entry = {token: Logprob(chosen_logprobs[i], ranks[i], tokenizer.decode([token]))}
        for rank, (token_id, value) in enumerate(zip(top_ids[i][:k], top_logprobs[i]), start=1):
            if token_id not in entry:
                entry[token_id] = Logprob(value, rank, tokenizer.decode([token_id]))
        entries.append(entry)
    return entries


def token_logprobs(
    logits: torch.Tensor, seqs: list[Sequence], tokens: list[int], tokenizer
) -> list[dict[int, Logprob] | None]:
    """Per sequence (row of logits): None, or its sampled token and params.logprobs top tokens."""
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    result: list[dict[int, Logprob] | None] = [None] * len(seqs)
    entries = logprob_entries(
        logits[rows], [tokens[i] for i in rows], [seqs[i].params.logprobs for i in rows], tokenizer
    )
    for i, entry in zip(rows, entries):
        result[i] = entry
    return result


def score_prompt(seq: Sequence, logits: torch.Tensor, start: int, tokenizer) -> None:
    """Extend seq.prompt_logprobs from one prompt_logits chunk: row j holds the logits at position start + j,
    which predict token start + j + 1. Positions scored before (a chunk recomputed after preemption) and past
    the prompt are skipped."""
    first = len(seq.prompt_logprobs) - 1 - start  # the row that predicts the next unscored prompt token
    last = min(logits.shape[0], seq.num_prompt_tokens - 1 - start)
    if first < 0 or first >= last:
        return
    targets = seq.token_ids[start + first + 1 : start + last + 1]
    seq.prompt_logprobs += logprob_entries(
        logits[first:last], targets, [seq.params.prompt_logprobs] * len(targets), tokenizer
    )
