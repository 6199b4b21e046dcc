"""Examples to ``asyncrl.Prompt``: the chat template applied once, and no encoding that loses text.

A tokenizer that does not know a character may map it to its unknown token, or drop it without a word (a
byte-level BPE whose alphabet lacks it: ``"Tom has 12 apples and buys 7 more."`` can come out as the ids of
``"127"``). A model trained on that sees other problems than the data holds, so every encoding is checked:
no unknown-token ids, and the ids decode back to the text (whitespace runs, Unicode normalisation and
special tokens aside). A prompt that fails is a ``ValueError`` naming the example, the text and what it
decodes as.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from typing import Any, Literal

from asyncrl.data.files import Example
from asyncrl.types import Prompt

ChatTemplate = Literal["auto"] | bool
Messages = list[dict[str, str]]


def prompt_text(prompt: str | Messages, tokenizer: Any, chat_template: ChatTemplate = "auto") -> str:
    """The text the model sees for ``prompt``.

    ``chat_template="auto"``: chat messages go through the tokenizer's chat template (generation prompt added),
    or, if it has none, their contents are joined with newlines; a string is used as it is. ``True``: a string
    becomes one user message, and a tokenizer without a template is an error. ``False``: no template; messages
    are joined.
    """
    return _render(prompt, tokenizer, chat_template)[0]


def encode_prompt(prompt: str | Messages, tokenizer: Any, chat_template: ChatTemplate = "auto") -> tuple[int, ...]:
    """Token ids of ``prompt`` (``prompt_text``), refused if the tokenizer loses any of it (module docstring).
    Templated text already holds whatever BOS the template writes, so the tokenizer adds no special tokens
    to it; a plain string gets the tokenizer's usual ones."""
    text, templated = _render(prompt, tokenizer, chat_template)
    return _encode(text, templated, tokenizer)


def encode_prompts(examples: Sequence[Example], tokenizer: Any, chat_template: ChatTemplate = "auto",
                   id_prefix: str = "prompt-") -> list[Prompt]:
    """One ``Prompt`` per example: ``prompt_id`` is ``id_prefix`` + its index, ``text`` the text the model sees,
    ``answer`` the example's answer. A lossy encoding is a ``ValueError`` naming the example's index."""
    prompts = []
    for i, ex in enumerate(examples):
        text, templated = _render(ex.prompt, tokenizer, chat_template)
        try:
            ids = _encode(text, templated, tokenizer)
        except ValueError as e:
            raise ValueError(f"example {i}: {e}") from None
        prompts.append(Prompt(f"{id_prefix}{i}", ids, text, ex.answer))
    return prompts


def _render(prompt: str | Messages, tokenizer: Any, chat_template: ChatTemplate) -> tuple[str, bool]:
    if chat_template not in ("auto", True, False):
        raise ValueError(f"chat_template must be 'auto', True or False, not {chat_template!r}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_template is True and not has_template:
        raise ValueError("chat_template=True, but the tokenizer has no chat template")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) and chat_template is True \
        else prompt
    if isinstance(messages, str):
        return messages, False
    if chat_template is False or not has_template:
        return "\n".join(m["content"] for m in messages), False
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), True


def _encode(text: str, templated: bool, tokenizer: Any) -> tuple[int, ...]:
    ids = tuple(tokenizer(text, add_special_tokens=not templated).input_ids)
    unk_id, unk = getattr(tokenizer, "unk_token_id", None), getattr(tokenizer, "unk_token", None)
    if unk_id is not None and ids.count(unk_id) > (text.count(unk) if unk else 0):
        raise ValueError(f"the tokenizer maps characters of {_show(text)} to its unknown token {unk!r}: it "
                         f"decodes as {_show(tokenizer.decode(ids, skip_special_tokens=False))}; use a "
                         f"tokenizer that knows every character of the data")
    decoded = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if _same(decoded, text):
        return ids
    # A tokenizer may add special tokens (BOS) or space around them: compare the rest.
    specials = _special_tokens(tokenizer)
    bare = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if _same(_without(bare, specials), _without(text, specials)):
        return ids
    raise ValueError(f"the tokenizer loses text: {_show(text)} decodes as {_show(decoded)}; use a tokenizer "
                     f"that knows every character of the data")


def _special_tokens(tokenizer: Any) -> set[str]:
    found = set(getattr(tokenizer, "all_special_tokens", ()))
    found |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    return found


def _without(text: str, tokens: set[str]) -> str:
    for token in tokens:
        text = text.replace(token, " ")
    return text


def _same(a: str, b: str) -> bool:
    return _normal(a) == _normal(b)


def _normal(text: str) -> str:
    return " ".join(unicodedata.normalize("NFC", text).split())


def _show(text: str, limit: int = 300) -> str:
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"
