"""Text from the bus, made safe to show on an operator's terminal.

Whoever may publish on an events subject chooses its strings: a request id holding ESC [2J clears
the auditor's screen, and one holding U+202E (right-to-left override) shows the rest of its line,
a mark of FORGED included, reversed. So every such string is shown with its control characters
escaped (C0, DEL, C1, and Unicode's format, bidi and line-separator controls); all else as it is.
"""

from __future__ import annotations

import json
import unicodedata

# control (C0, DEL, C1), format (bidi, zero-width), lone surrogates, line and paragraph separators
_CONTROL = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_JSON_SPACE = frozenset("\t\n\r")  # raw in a valid JSON text only between its tokens


def printable(text: str) -> str:
    """`text` with each control character escaped as \\x1b, \\u202e or \\U000e0001."""
    if text.isprintable():  # nothing to escape (the common case, at no cost per character)
        return text
    return "".join(_escaped(c) if unicodedata.category(c) in _CONTROL else c for c in text)


def printable_json(text: str) -> str:
    """A valid JSON text on one line and safe to print, meaning what `text` means: a control
    character in a string as its JSON escape (\\u202e), a line break between tokens as a space."""
    if text.isprintable():
        return text
    return "".join(" " if c in _JSON_SPACE else json.dumps(c)[1:-1] if unicodedata.category(c) in _CONTROL else c
                   for c in text)


def _escaped(c: str) -> str:
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
