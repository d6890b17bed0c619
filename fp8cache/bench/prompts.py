"""Benchmark prompts: windows of exactly N tokens cut from the WikiText-2 test text.

Every window starts at its own place in the text, so no two prompts share a first block and the prefix
cache cannot turn a measured prefill into a lookup. A `PromptSource` hands out fresh windows on each
call, so warm-up and timed runs on one engine never see the same prompt twice.
"""

from __future__ import annotations

from fp8cache.quality.eval import locate_eval_text, read_text

# Tokenizing the whole text (1.3 MB) takes seconds; a prefix of about this many characters per needed
# token is enough, and we grow it if not.
_CHARS_PER_TOKEN = 6
REPEAT_CUE = 8  # tokens of the passage that start its repetition in a repeat prompt


class PromptSource:
    def __init__(self, tokenizer, text_path: str | None = None) -> None:
        """tokenizer: a Hugging Face tokenizer. text_path: None takes $FP8KV_EVAL_TEXT, else the WikiText-2
        test text shipped in the package (fp8cache.quality.eval.locate_eval_text)."""
        self.tokenizer = tokenizer
        self.text = read_text(locate_eval_text(text_path))
        self._ids: list[int] = []
        self._chars_tokenized = 0
        self._next_start = 0

    def take(self, count: int, length: int) -> list[list[int]]:
        """`count` new windows of exactly `length` token ids."""
        if count < 1 or length < 1:
            raise ValueError(f"need at least one prompt of at least one token, got {count} x {length}")
        needed = self._next_start + count * length
        ids = self._token_ids(needed)
        if len(ids) >= needed:
            starts = [self._next_start + i * length for i in range(count)]
            self._next_start = needed
        else:
            # The text is too short for disjoint windows: let them overlap, each still starting elsewhere.
            room = len(ids) - length
            if room < count:
                raise ValueError(f"the evaluation text has {len(ids)} tokens, too few for {count} distinct "
                                 f"prompts of {length} tokens; use fewer or shorter prompts")
            starts = [(self._next_start + i * max(1, room // count)) % room for i in range(count)]
            self._next_start = (starts[-1] + 1) % room
        return [ids[s:s + length] for s in starts]

    def take_repeat(self, count: int, length: int) -> list[list[int]]:
        """`count` prompts of exactly `length` tokens that repeat their context: a passage of the text, a blank
        line and the passage's first REPEAT_CUE tokens again, so that the model goes on copying it (the text
        an edit, summary or quotation repeats; where n-gram speculation gains)."""
        gap = self.tokenizer("\n\n", add_special_tokens=False)["input_ids"]
        passage_len = length - len(gap) - REPEAT_CUE
        if passage_len <= REPEAT_CUE:
            raise ValueError(f"a repeat prompt needs more than {2 * REPEAT_CUE + len(gap)} tokens, got {length}")
        return [p + gap + p[:REPEAT_CUE] for p in self.take(count, passage_len)]

    def take_text(self, count: int, length: int) -> list[str]:
        """Like take(), decoded to text (for HTTP clients; the server's count may differ by a token)."""
        return [self.tokenizer.decode(w) for w in self.take(count, length)]

    def _token_ids(self, needed: int) -> list[int]:
        while len(self._ids) < needed and self._chars_tokenized < len(self.text):
            chars = min(len(self.text), max(needed * _CHARS_PER_TOKEN, 2 * self._chars_tokenized))
            # No BOS or other special tokens: a window is plain text from the middle of a document.
            self._ids = self.tokenizer(self.text[:chars], add_special_tokens=False)["input_ids"]
            self._chars_tokenized = chars
        return self._ids
