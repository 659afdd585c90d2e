"""Which token a new drafter marks masked positions with, for a verifier whose tokenizer has no mask token (most
instruct tokenizers: SmolLM2, Qwen, Llama).

A diffusion drafter needs one id that stands for "not yet drafted". It must be an id the verifier's data never
holds, or the drafter would read real text as masked: so not the BOS, EOS, pad or unknown token, and no token the
chat template writes. A DFlash drafter shares the verifier's embeddings, so the id must also have an embedding row.
In order of preference (the first that exists):

1. the tokenizer's own mask token;
2. an embedding row past the tokenizer's vocabulary (checkpoints padded to a multiple of 64 or 128, as Qwen's are:
   a row no text ever reaches);
3. the last of the tokenizer's added special tokens that none of the above excludes (SmolLM2's `<empty_output>`,
   id 16: a code-dataset marker the chat model never writes).

Nothing is added to the tokenizer: a new row would need the verifier's embedding matrix (and vLLM's copy of it) to
grow. When nothing qualifies, the recipe names one (`dflash.mask_token_id`), checked by the same rules.
"""

from __future__ import annotations

from typing import Any, Optional

from align.config import Recipe, RecipeError


def _reserved_ids(tokenizer: Any, chat_template: Optional[str]) -> set[int]:
    """Ids the verifier reads in real data: its BOS/EOS/pad/unknown tokens and every special token the template
    writes."""
    reserved = {i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
                            tokenizer.unk_token_id) if i is not None}
    if chat_template:
        reserved |= {i for i, token in tokenizer.added_tokens_decoder.items() if token.content in chat_template}
    return reserved


def choose_mask_token(tokenizer: Any, vocab_size: int, chat_template: Optional[str], given: Optional[int] = None,
                      key: str = "dflash.mask_token_id") -> tuple[int, str]:
    """(mask token id, how it was chosen, said to the user and kept in the run's manifest) for a drafter over a
    vocabulary of `vocab_size` embedding rows. `given`: the recipe's own choice, checked. Raises RecipeError (naming
    `key`) when the given id cannot serve or none can be chosen."""
    reserved = _reserved_ids(tokenizer, chat_template)
    if given is not None:
        if given >= vocab_size:
            raise RecipeError(f"{key}: {given} is outside the verifier's vocabulary ({vocab_size} embedding rows)")
        if given in reserved:
            raise RecipeError(f"{key}: {given} ({tokenizer.convert_ids_to_tokens(given)!r}) is a token the verifier "
                              "reads in its data (BOS, EOS, pad or a chat-template marker); the drafter would take it "
                              "for a masked position. Choose an unused special token")
        special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
        if given < len(tokenizer) and given not in special | set(tokenizer.all_special_ids):
            raise RecipeError(f"{key}: {given} ({tokenizer.convert_ids_to_tokens(given)!r}) is an ordinary token of "
                              "the verifier's text; the drafter would take each one in its data for a masked "
                              f"position. Choose an unused special token, or a row past the tokenizer's "
                              f"{len(tokenizer)} tokens")
        return given, f"id {given} ({tokenizer.convert_ids_to_tokens(given)!r}), as {key} says"
    if tokenizer.mask_token_id is not None:
        return tokenizer.mask_token_id, f"the tokenizer's mask token {tokenizer.mask_token!r} (id {tokenizer.mask_token_id})"
    if vocab_size > len(tokenizer):
        return len(tokenizer), (f"id {len(tokenizer)}, the first embedding row past the tokenizer's {len(tokenizer)} "
                                "tokens (no text reaches it)")
    unused = sorted(i for i, token in tokenizer.added_tokens_decoder.items()
                    if token.special and i not in reserved and i < vocab_size)
    if unused:
        chosen = unused[-1]
        return chosen, (f"{tokenizer.convert_ids_to_tokens(chosen)!r} (id {chosen}), a special token of the "
                        "tokenizer that is not its BOS, EOS or pad and that its chat template never writes")
    raise RecipeError(f"{key}: the verifier's tokenizer has no mask token, no embedding row past its vocabulary and "
                      f"no unused special token; name an id the verifier never reads ({key}=<id>)")


def dflash_mask_token(recipe: Recipe) -> tuple[int, str]:
    """choose_mask_token for the recipe's new DFlash drafter: over the verifier's tokenizer and embedding rows, with
    the template its prompts are rendered with (only the tokenizer and the config are read)."""
    from align.data import recipe_chat_template
    from align.preflight import load_model_config
    from align.models import load_tokenizer

    tokenizer = load_tokenizer(recipe.verifier.path, recipe.verifier.trust_remote_code)
    vocab_size = int(load_model_config("verifier.path", recipe.verifier).get_text_config().vocab_size)
    return choose_mask_token(tokenizer, vocab_size, recipe_chat_template(recipe, "verifier.path"),
                             recipe.dflash.mask_token_id)
