"""What generate() and step() hand back, shaped like vLLM's classes of the same names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int  # which of the request's n outputs
    text: str  # cumulative
    token_ids: list[int]  # cumulative
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it, if any

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
