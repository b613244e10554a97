"""Incremental detokenization with stop strings.

Text is released only when it is final: a token that ends inside a multi-byte character
decodes to U+FFFD until the next token completes it, and text that could be the start of a
stop string is held back until it is known not to be. NOTE: decoding a window of recent
tokens (not only the new one) keeps word-boundary spaces right for SentencePiece-style
tokenizers.
"""

from __future__ import annotations

_WINDOW = 6  # tokens of left context decoded with the new ones
_MAX_PENDING = 4  # a UTF-8 character spans at most 4 byte tokens; past that the bytes are invalid


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""  # all final text so far (stop string excluded)
        self.sent = 0  # chars of self.text already released
        self.stopped = False
        self._prefix = 0  # ids[_prefix:_read] decode to text already appended
        self._read = 0

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text that can now be released."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        self._absorb(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of the request: release everything held back."""
        if not self.stopped:
            self._absorb(final=True)
        return self._release(final=True)

    def _absorb(self, final: bool) -> None:
        """Move newly decodable text from the token ids into self.text."""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        incomplete = after.endswith("\ufffd") and len(self.ids) - self._read < _MAX_PENDING
        if (incomplete and not final) or len(after) <= len(before):
            return  # a character split across tokens: wait for the rest
        self.text += after[len(before):]
        self._prefix = max(0, len(self.ids) - _WINDOW)
        self._read = len(self.ids)

    def _release(self, final: bool) -> str:
        hits = [i for i in (self.text.find(s, max(0, self.sent - len(s))) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            final = True
        hold = 0 if final else self._held_back()
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent:end], end
        return out

    def _held_back(self) -> int:
        """Chars at the end of the text that might begin a stop string."""
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return hold

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
