"""Incremental detokenization and the stop checks that depend on text.

Text grows by decoding a short window of ids twice, with and without the newest tokens, and taking
the difference: the window keeps tokenizer-specific joins (leading spaces, byte pieces) right without
re-decoding everything. A window whose text ends in U+FFFD stops at a partial UTF-8 character, so
nothing is emitted until the next token completes it.
"""

from __future__ import annotations

from fp8cache.engine.sequence import Sequence

REPLACEMENT_CHAR = "\ufffd"


def decode_new_text(tokenizer, seq: Sequence, flush: bool = False) -> str:
    """Append the text of seq's newest tokens to seq.output_text and return that piece.

    flush: emit even an incomplete trailing character (the sequence is over, nothing will complete it).
    """
    ids = seq.token_ids
    skip = seq.params.skip_special_tokens
    prefix_text = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
    new_text = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
    if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not flush):
        return ""
    delta = new_text[len(prefix_text):]
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
    seq.output_text += delta
    return delta


def check_stop(tokenizer, seq: Sequence, eos_token_ids: set[int], max_model_len: int) -> None:
    """Detokenize seq's newest token and set seq.finish_reason / stop_reason if it should end.

    Order as in vLLM: min_tokens, eos, stop_token_ids, stop strings, then the length limits.
    """
    p = seq.params
    token = seq.token_ids[-1]
    reached_min = seq.num_output_tokens >= p.min_tokens
    if reached_min and not p.ignore_eos and token in eos_token_ids:
        seq.finish_reason = "stop"
        return  # the eos token's own text is not part of the output
    if reached_min and token in p.stop_token_ids:
        seq.finish_reason, seq.stop_reason = "stop", token
        if p.include_stop_str_in_output:
            decode_new_text(tokenizer, seq, flush=True)
        return
    at_length_limit = (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) \
        or len(seq) >= max_model_len
    delta = decode_new_text(tokenizer, seq, flush=at_length_limit)
    if reached_min and delta and _truncate_at_stop_string(seq, len(delta)):
        return
    if at_length_limit:
        seq.finish_reason = "length"


def _truncate_at_stop_string(seq: Sequence, delta_len: int) -> bool:
    text = seq.output_text
    best: tuple[int, str] | None = None
    for stop in seq.params.stop_strings:
        # Only the new text, and the stop-string-long tail before it, can hold a new match.
        at = text.find(stop, max(len(text) - delta_len - len(stop) + 1, 0))
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    if best is None:
        return False
    at, stop = best
    seq.output_text = text[:at + len(stop)] if seq.params.include_stop_str_in_output else text[:at]
    seq.finish_reason, seq.stop_reason = "stop", stop
    return True
