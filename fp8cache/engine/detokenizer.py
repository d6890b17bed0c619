"""Incremental detokenization and the stop checks that depend on text.

Text grows by decoding a short window of ids twice, with and without the newest tokens, and taking
the difference: the window keeps tokenizer-specific joins (leading spaces, byte pieces) right without
re-decoding everything. A window whose text ends in U+FFFD stops at a partial UTF-8 character, so
nothing is emitted until the next token completes it.

check_stops does a whole step's sequences at once: with a Rust ("fast") tokenizer whose decode is the Rust
decode itself, every window of the step is decoded in one call instead of two Python calls a sequence (the
largest share of the host's work in a decode step of many sequences).
"""

from __future__ import annotations

from fp8cache.engine.sequence import Sequence

REPLACEMENT_CHAR = "\ufffd"


def decode_new_text(tokenizer, seq: Sequence, flush: bool = False, window: tuple[str, str] | None = None) -> str:
    """Append the text of seq's newest tokens to seq.output_text and return that piece.

    flush: emit even an incomplete trailing character (the sequence is over, nothing will complete it).
    window: the two texts of _windows(seq), when decoded already (check_stops).
    """
    ids = seq.token_ids
    if window is None:
        window = tuple(decode_all(tokenizer, _windows(seq), [seq.params.skip_special_tokens] * 2))
    prefix_text, new_text = window
    if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not flush):
        return ""
    delta = new_text[len(prefix_text):]
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
    seq.output_text += delta
    return delta


def _windows(seq: Sequence) -> list[list[int]]:
    """The ids decoded for seq's newest text: the window before its unread tokens, and with them."""
    return [seq.token_ids[seq.prefix_offset:seq.read_offset], seq.token_ids[seq.prefix_offset:]]


def decode_all(tokenizer, ids: list[list[int]], skip_special_tokens: list[bool]) -> list[str]:
    """tokenizer.decode of each list of ids, in one call to the Rust tokenizer where that gives the same texts."""
    backend = _batch_decoder(tokenizer)
    if backend is None:
        return [tokenizer.decode(i, skip_special_tokens=s) for i, s in zip(ids, skip_special_tokens)]
    texts: list[str] = [""] * len(ids)
    for skip in (False, True):
        rows = [n for n, s in enumerate(skip_special_tokens) if s == skip]
        if rows:
            for n, text in zip(rows, backend.decode_batch([ids[n] for n in rows], skip_special_tokens=skip)):
                texts[n] = text
    return texts


def _batch_decoder(tokenizer):
    """The Rust tokenizer behind a transformers tokenizer whose decode is exactly its decode (no space clean-up,
    decode not overridden), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "decode_batch") or getattr(tokenizer, "clean_up_tokenization_spaces",
                                                                          True):
        return None
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    if cls.decode is not PreTrainedTokenizerFast.decode or cls._decode is not PreTrainedTokenizerFast._decode:
        return None
    return backend


def check_stops(tokenizer, seqs: list[Sequence], eos_token_ids: set[int], max_model_len: int) -> None:
    """check_stop for each of seqs (each has just got a token), their texts decoded together."""
    ids = [window for seq in seqs for window in _windows(seq)]
    texts = decode_all(tokenizer, ids, [seq.params.skip_special_tokens for seq in seqs for _ in range(2)])
    for n, seq in enumerate(seqs):
        check_stop(tokenizer, seq, eos_token_ids, max_model_len, (texts[2 * n], texts[2 * n + 1]))


def check_stop(tokenizer, seq: Sequence, eos_token_ids: set[int], max_model_len: int,
               window: tuple[str, str] | None = None) -> None:
    """Detokenize seq's newest token and set seq.finish_reason / stop_reason if it should end.

    Order as in vLLM: min_tokens, eos, stop_token_ids, stop strings, then the length limits. window: as in
    decode_new_text.
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
            decode_new_text(tokenizer, seq, flush=True, window=window)
        return
    at_length_limit = (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) \
        or len(seq) >= max_model_len
    delta = decode_new_text(tokenizer, seq, flush=at_length_limit, window=window)
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
