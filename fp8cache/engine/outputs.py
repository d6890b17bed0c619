"""What generate() and step() hand back, shaped like vLLM's classes of the same names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability under the model's own distribution (its raw logits: before penalties,
    temperature, top-k/p, as vLLM reports by default)."""

    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int  # which of the request's n outputs
    text: str  # cumulative
    token_ids: list[int]  # cumulative
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs, with logprobs requested
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it, if any
    # With SamplingParams.logprobs = k: one dict per token of token_ids, the sampled token and the k most
    # likely ones (k + 1 entries, or k when the sampled token is among them).
    logprobs: list[dict[int, Logprob]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # With SamplingParams.prompt_logprobs = k: None for the first prompt token (nothing predicts it), then one
    # dict per prompt token as in CompletionOutput.logprobs.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
