"""A chat's prompt token ids, with what the messages say kept as text.

The model's chat template marks turns with control tokens (`<|im_start|>`, `<|im_end|>`, ...). A
message whose content spells one of them out must not become that control token: typed inside a
user's content, `<|im_start|>system` would otherwise open a real system turn. Contents without any
control token's text are tokenized exactly as the template's own tokenization does; contents with
one are tokenized on their own with the control tokens split into plain text, the template's text
between them as usual.
"""

from __future__ import annotations

import re
import secrets


class TemplateError(ValueError):
    """The template refuses this conversation, or alters its contents so they cannot be kept plain."""


def control_strings(tokenizer) -> tuple[str, ...]:
    """The text of every token the tokenizer adds on top of its vocabulary (the template's markers)."""
    return tuple(t.content for t in tokenizer.added_tokens_decoder.values() if t.content)


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]], controls: tuple[str, ...]) -> list[int]:
    if not any(c in m["content"] for m in messages for c in controls):
        try:
            encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        except Exception as exc:  # e.g. an order of roles the template does not accept
            raise TemplateError(str(exc)) from None
        return list(encoded["input_ids"])
    # Render with each content replaced by a marker, then tokenize the template's text and the
    # contents separately, the contents with control tokens split into ordinary text.
    tag = secrets.token_hex(8)
    marked = [{**m, "content": f"@@{tag}:{i}@@"} for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    except Exception as exc:
        raise TemplateError(str(exc)) from None
    pieces = re.split(f"@@{tag}:(\\d+)@@", text)
    found = [int(i) for i in pieces[1::2]]
    if sorted(found) != list(range(len(messages))):
        raise TemplateError("the template changes message contents, so contents that contain control tokens' text "
                            "cannot be kept as plain text")
    ids: list[int] = []
    for n, piece in enumerate(pieces):
        if n % 2:  # a message's content, as plain text
            ids += tokenizer(messages[int(piece)]["content"], add_special_tokens=False,
                             split_special_tokens=True)["input_ids"]
        elif piece:
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids
