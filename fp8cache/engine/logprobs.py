"""Log-probabilities of the sampled tokens and of the most likely ones, for requests that ask for them.

They come from the model's raw logits (vLLM's default): min_tokens bans, penalties, temperature and
top-k/p shape what is drawn, not what is reported, so a greedy and a sampled request agree on the numbers.
"""

from __future__ import annotations

import torch

from fp8cache.engine.outputs import Logprob
from fp8cache.engine.sequence import Sequence


def token_logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int],
                   tokenizer) -> list[dict[int, Logprob] | None]:
    """Per sequence (row of logits): None, or its sampled token and params.logprobs top tokens."""
    result: list[dict[int, Logprob] | None] = [None] * len(seqs)
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return result
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = torch.tensor([tokens[i] for i in rows], device=logprobs.device).unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen)
    ranks = (logprobs > chosen_logprobs).sum(dim=1) + 1
    k = max(seqs[i].params.logprobs for i in rows)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    chosen_logprobs, ranks = chosen_logprobs.squeeze(1).tolist(), ranks.tolist()
    top_logprobs, top_ids = top_logprobs.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        token = tokens[i]
        entry = {token: Logprob(chosen_logprobs[j], ranks[j], tokenizer.decode([token]))}
        for rank, (token_id, value) in enumerate(zip(top_ids[j][:seqs[i].params.logprobs],
                                                     top_logprobs[j]), start=1):
            if token_id not in entry:
                entry[token_id] = Logprob(value, rank, tokenizer.decode([token_id]))
        result[i] = entry
    return result
