"""Incremental detokenization with stop strings.

The tokenizers library's DecodeStream turns token ids into text as they arrive (it holds a
token that ends inside a multi-byte character until the next one completes it, and decodes
with enough left context to keep word-boundary spaces right). What is ours is the stop strings:
text is released only when it cannot be the start of one, and a request stops at the first.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer.backend_tokenizer  # the tokenizers.Tokenizer of a transformers fast tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""  # all final text so far (stop string excluded)
        self.sent = 0  # chars of self.text already released
        self.stopped = False
        self._stream = DecodeStream(skip_special_tokens=True)
        self._pending = False  # the stream holds ids it has not turned into text yet

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text that can now be released."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        piece = self._stream.step(self.tokenizer, list(token_ids))
        self._pending = piece is None
        self.text += piece or ""
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of the request: release everything held back."""
        if self._pending and not self.stopped:
            # NOTE: the stream never releases bytes that do not complete a character; the
            # whole decode does (as U+FFFD), as a client reading the full text would get them
            whole = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if whole.startswith(self.text):
                self.text = whole
        return self._release(final=True)

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
