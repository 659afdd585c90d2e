"""What a chat template says about its turns: the text before and after a user's message, and the token that ends a
turn. Magpie (align/stages/prompts.py) samples a user's message from the text before it; a converted verifier
(align/stages/convert.py) stops generating at the end-of-turn token.

Both are read off the template itself, by rendering a conversation whose one user message is a marker and splitting
the text there, so every template (ChatML, Gemma's, Llama 3's) is read the same way, with its default system prompt.
"""

from __future__ import annotations

from typing import Any, Optional

from align.config import RecipeError

# A message no real conversation holds, and that no template escapes or trims (letters and punctuation only).
MARKER = "@@ALIGN-USER-MESSAGE@@"


def user_turn(tokenizer: Any, template: str, system: Optional[str] = None) -> tuple[str, str]:
    """(prefix, suffix): the rendered text before and after the user's message in a conversation that opens with
    it (the template's default system prompt included, as data.render_prompt renders a user-only prompt), or with a
    system message `system` before it."""
    conversation = [{"role": "user", "content": MARKER}]
    if system is not None:
        conversation.insert(0, {"role": "system", "content": system})
    text = tokenizer.apply_chat_template(conversation, chat_template=template, add_generation_prompt=False,
                                         tokenize=False)
    if text.count(MARKER) != 1:
        raise RecipeError("data.chat_template: the chat template does not render a user message as it is given, so "
                          "the text before a user's message cannot be read off it")
    prefix, suffix = text.split(MARKER)
    return prefix, suffix


def special_ids(tokenizer: Any) -> set[int]:
    """Every special token id: the named ones (bos, eos, pad...) and the added tokens marked special (turn markers)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, token in added.items() if getattr(token, "special", False)}


def end_of_turn_ids(tokenizer: Any, template: str) -> list[int]:
    """The token that closes a user's message (ChatML's <|im_end|>, Gemma's <end_of_turn>): the first token after the
    message, when it is a special token; [] for a template that ends turns with plain text."""
    _, suffix = user_turn(tokenizer, template)
    ids = tokenizer(suffix, add_special_tokens=False).input_ids
    return [ids[0]] if ids and ids[0] in special_ids(tokenizer) else []
