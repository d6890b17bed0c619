"""Turn one row of logits per sequence into one token per sequence, all rows at once.

Order, as in vLLM: logit bias -> min_tokens bans -> penalties -> structured output mask -> greedy argmax, or
temperature -> min-p -> top-k -> top-p -> typical-p (TGI's last warper) -> draw. The draw is argmax(p / q)
with q ~ Exp(1), which is a draw from p; a seeded request makes its own q from its own generator, so its
tokens do not depend on what else is in the batch.

Nothing here waits for the device unless a feature reads device values on the host (structured-output masks,
penalties: the engine runs those steps synchronously). Per-row settings are decided from the host's
SamplingParams and reach the device as non-blocking copies from pinned memory, so that sampling can be queued
behind a step that is still running (the overlapped loop).
"""

from __future__ import annotations

import torch

from fp8cache.engine.sequence import Sequence


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        self._device_generators: dict[torch.device, torch.Generator] = {}

    def _generator_for(self, device: torch.device) -> torch.Generator | None:
        """The CPU generator for CPU logits; on a GPU one of its own, so that the noise is drawn where the
        logits are instead of copied there (a batch x vocabulary copy every step)."""
        if device.type == "cpu":
            return self.generator
        if device.type == "meta":  # a stand-in device (tests): no data, no generator
            return None
        if device not in self._device_generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
            self._device_generators[device] = generator
        return self._device_generators[device]

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> list[int]:
        return self.sample(logits, seqs, eos_token_ids).tolist()  # one copy, one wait for the device

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> torch.Tensor:
        """One token per row (int64), on the logits' device: queued, not waited for."""
        logits = self.edited(logits, seqs, eos_token_ids)
        tokens = logits.argmax(dim=-1)
        greedy = [s.params.greedy for s in seqs]
        if not all(greedy):
            probs = sampling_probs(logits, seqs)
            greedy_rows = to_device(greedy, torch.bool, logits.device)
            tokens = torch.where(greedy_rows, tokens, self.draw(probs, seqs))
        return tokens

    @staticmethod
    def edited(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> torch.Tensor:
        """float logits after logit bias, min_tokens bans, penalties and structured output masks."""
        if logits.shape[0] != len(seqs):
            raise ValueError(f"sampler got {logits.shape[0]} logit rows for {len(seqs)} sequences")
        logits = logits.float()
        if any(_edits_logits(s, eos_token_ids) for s in seqs):  # only these write in place
            logits = logits.clone()
            apply_logit_bias(logits, seqs)
            ban_stop_tokens_before_min(logits, seqs, eos_token_ids)
            apply_penalties(logits, seqs)
            apply_guides(logits, seqs)
        return logits

    def target_probs(self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> torch.Tensor:
        """The distribution sample() draws each row from (speculative decoding verifies against it)."""
        return sampling_probs(self.edited(logits, seqs, eos_token_ids), seqs)

    def draw(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        q = torch.empty(probs.shape, dtype=probs.dtype, device=probs.device)
        q.exponential_(generator=self._generator_for(probs.device))
        for i, seq in enumerate(seqs):
            if seq.generator is not None and not seq.params.greedy:  # a seeded request: its own CPU generator
                row = torch.empty(probs.shape[1], dtype=probs.dtype, pin_memory=_pins(probs.device))
                q[i].copy_(row.exponential_(generator=seq.generator), non_blocking=True)
        q.clamp_(min=torch.finfo(q.dtype).tiny)  # q == 0 would make a p == 0 token win (0/0 = nan)
        return (probs / q).argmax(dim=-1)


def _edits_logits(seq: Sequence, eos_token_ids: set[int]) -> bool:
    """Whether ban_stop_tokens_before_min or apply_penalties may change seq's row."""
    p = seq.params
    if p.logit_bias or seq.guide is not None:
        return True
    if seq.num_sampled_tokens < p.min_tokens and (p.stop_token_ids or (eos_token_ids and not p.ignore_eos)):
        return True
    return has_penalties(p)


def has_penalties(p) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def reads_host_history(seq: Sequence) -> bool:
    """Whether sampling seq's next token needs its newest token on the host: a structured-output mask (the
    automaton's state) or penalties (the tokens seen so far)."""
    return seq.guide is not None or has_penalties(seq.params)


def _pins(device: torch.device) -> bool:
    return device.type == "cuda"


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`, copied from pinned memory without waiting (a plain
    torch.tensor(..., device=cuda) copies from pageable memory and waits for the whole stream)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=_pins(device))
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


def _column(seqs: list[Sequence], name: str, device: torch.device) -> torch.Tensor:
    return to_device([float(getattr(s.params, name)) for s in seqs], torch.float32, device).unsqueeze(1)


def _put(logits: torch.Tensor, rows: list[int], cols: list[int], values: list[float] | float,
         accumulate: bool = False) -> None:
    """logits[rows[j], cols[j]] = (or +=) values[j], with the indices copied to the device without waiting."""
    if not rows:
        return
    device = logits.device
    index = (to_device(rows, torch.long, device), to_device(cols, torch.long, device))
    if isinstance(values, float):
        logits[index] = values
    else:
        logits.index_put_(index, to_device(values, logits.dtype, device), accumulate=accumulate)


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    rows, cols, values = [], [], []
    for i, seq in enumerate(seqs):
        bias = seq.params.logit_bias or {}
        rows += [i] * len(bias)
        cols += list(bias)
        values += list(bias.values())
    _put(logits, rows, cols, values, accumulate=True)


def apply_guides(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Structured outputs: tokens that cannot continue a match get -inf. Where that leaves nothing (min_tokens
    banned the end of sequence token, the only way on from a finished match), the allowed tokens come back
    level: the structure wins over min_tokens."""
    for i, seq in enumerate(seqs):
        if seq.guide is not None:
            allowed = seq.guide.allowed(logits.shape[1]).to(logits.device)
            logits[i].masked_fill_(~allowed, -float("inf"))
            if not bool(torch.isfinite(logits[i]).any()):
                logits[i].masked_fill_(allowed, 0.0)


def ban_stop_tokens_before_min(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> None:
    rows, cols = [], []
    for i, seq in enumerate(seqs):
        p = seq.params
        if seq.num_sampled_tokens < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            banned = sorted(t for t in banned if t < logits.shape[1])
            rows += [i] * len(banned)
            cols += banned
    _put(logits, rows, cols, -float("inf"))


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Repetition penalty over prompt and output tokens; presence and frequency over output tokens."""
    rows = [i for i, s in enumerate(seqs) if has_penalties(s.params)]
    vocab = logits.shape[1]
    for i in rows:
        p, seq = seqs[i].params, seqs[i]
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({t for t in seq.token_ids if t < vocab}), dtype=torch.long,
                                device=logits.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            out = torch.tensor([t for t in seq.output_token_ids if t < vocab], dtype=torch.long,
                               device=logits.device)
            counts = torch.bincount(out, minlength=vocab).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def sampling_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Probabilities after temperature, min-p, top-k, top-p and typical-p (rows of greedy sequences are
    unused)."""
    temperature = _column(seqs, "temperature", logits.device)
    logits = logits / torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    if any(s.params.min_p > 0 for s in seqs):  # decided on the host: no wait for the device
        min_p = _column(seqs, "min_p", logits.device)
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, -float("inf"))
    logits = top_k_top_p(logits, seqs)
    logits = typical(logits, seqs)
    return logits.softmax(dim=-1)


def typical(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Locally typical sampling (Meister et al.; transformers' TypicalLogitsWarper, as TGI runs it): keep the
    tokens whose surprisal is closest to the distribution's entropy until their mass reaches typical_p."""
    if all(s.params.typical_p >= 1 for s in seqs):
        return logits
    mass = _column(seqs, "typical_p", logits.device)
    logprobs = logits.log_softmax(dim=-1)
    entropy = -(logprobs.exp() * logprobs).nansum(dim=-1, keepdim=True)
    distance, order = (-logprobs - entropy).abs().sort(dim=-1)
    cumulative = logits.gather(1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=-1, keepdim=True).clamp(max=logits.shape[1] - 1)
    drop = distance > distance.gather(1, last)
    drop[:, 0] = False  # always keep one token
    drop &= mass < 1
    return logits.masked_fill(torch.empty_like(drop).scatter_(1, order, drop), -float("inf"))


def top_k_top_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    vocab = logits.shape[1]
    ks = [s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in seqs]
    if all(k == vocab for k in ks) and all(s.params.top_p >= 1 for s in seqs):
        return logits
    top_k = to_device(ks, torch.long, logits.device)
    top_p = _column(seqs, "top_p", logits.device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, -float("inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Keep the smallest set whose mass reaches top_p (always >= 1 token: the first, whatever top_p rounds to);
    # top_p == 1 keeps everything, even where rounding pushes the running sum past 1.
    drop = (mass_before >= top_p) & (top_p < 1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, -float("inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
