"""The mask token of a new drafter for a verifier whose tokenizer has none (align/drafters/mask_token.py): chosen by rule and
said, or the recipe's own checked; refused before any launcher starts when nothing can serve. Tokenizers are the
shipped tiny family's, with their mask token taken away or special tokens added as real instruct tokenizers have."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from align.cli import main
from align.config import RecipeError
from align.decoding.ar import ar_generate
from align.decoding.specdiff import specdiff_generate
from align.drafters.loading import new_dflash_drafter
from align.drafters.mask_token import choose_mask_token, dflash_mask_token
from align.recipe_files import load_recipe

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "checkpoints" / "tiny" / "verifier"
# SmolLM2's template's shape: its turn markers are special tokens the template writes.
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def instruct_tokenizer(specials: list[str] = ("<|im_start|>", "<|im_end|>", "<repo_name>", "<empty_output>")):
    """The tiny tokenizer as an instruct one: no mask token, EOS <|im_end|>, code-dataset markers beside the turn
    markers (SmolLM2's added tokens 1-16)."""
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    tokenizer.mask_token = None
    tokenizer.add_special_tokens({"additional_special_tokens": list(specials)})
    tokenizer.eos_token = "<|im_end|>"
    return tokenizer


def test_the_tokenizers_own_mask_token_comes_first():
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    chosen, how = choose_mask_token(tokenizer, len(tokenizer) + 64, TEMPLATE)
    assert chosen == tokenizer.mask_token_id and "the tokenizer's mask token" in how


def test_a_padded_embedding_row_comes_before_any_token_text_can_reach():
    tokenizer = instruct_tokenizer()
    chosen, how = choose_mask_token(tokenizer, len(tokenizer) + 64, TEMPLATE)  # Qwen's checkpoints are padded so
    assert chosen == len(tokenizer) and "past the tokenizer's" in how


def test_else_an_unused_special_token_never_a_turn_marker_or_the_eos():
    tokenizer = instruct_tokenizer()
    chosen, how = choose_mask_token(tokenizer, len(tokenizer), TEMPLATE)
    assert tokenizer.convert_ids_to_tokens(chosen) == "<empty_output>" and "<empty_output>" in how
    # Nothing left: every special token below the vocabulary's end is the EOS, the pad or written by the template.
    bare = AutoTokenizer.from_pretrained(TINY)  # <|endoftext|> (EOS) 0, <|pad|> 1, <|mask|> 2
    bare.mask_token = None
    with pytest.raises(RecipeError, match=r"^dflash.mask_token_id: the verifier's tokenizer has no mask token"):
        choose_mask_token(bare, 3, TEMPLATE + "<|mask|>")
    assert choose_mask_token(bare, 3, TEMPLATE)[0] == 2  # unless the template leaves <|mask|> unused


def test_a_given_id_is_checked_by_the_same_rules():
    tokenizer = instruct_tokenizer()
    unused = tokenizer.convert_tokens_to_ids("<repo_name>")
    assert choose_mask_token(tokenizer, len(tokenizer), TEMPLATE, given=unused)[0] == unused
    for reserved in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_start|>")):
        with pytest.raises(RecipeError, match=r"^dflash.mask_token_id: \d+ .* is a token the verifier reads"):
            choose_mask_token(tokenizer, len(tokenizer), TEMPLATE, given=reserved)
    with pytest.raises(RecipeError, match=r"^dflash.mask_token_id: \d+ is outside the verifier's vocabulary"):
        choose_mask_token(tokenizer, len(tokenizer), TEMPLATE, given=len(tokenizer))
    # a piece of text (issue 35: SmolLM2's 'Ġthe' was taken): every one in the data would read as a masked position
    word = max(set(range(len(tokenizer))) - set(tokenizer.all_special_ids) - set(tokenizer.added_tokens_decoder))
    with pytest.raises(RecipeError, match=r"^dflash.mask_token_id: \d+ \(.*\) is an ordinary token"):
        choose_mask_token(tokenizer, len(tokenizer), TEMPLATE, given=word)
    assert choose_mask_token(tokenizer, len(tokenizer) + 8, TEMPLATE, given=len(tokenizer))[0] == len(tokenizer)


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)  # the shipped recipes name checkpoints/tiny relative to the repository


@pytest.fixture
def maskless_verifier(tmp_path) -> Path:
    """The tiny verifier with an instruct tokenizer: no mask token, a chat template."""
    folder = tmp_path / "verifier"
    shutil.copytree(TINY, folder)
    (folder / "sha256.json").unlink(missing_ok=True)  # its tokenizer is changed on purpose
    tokenizer = instruct_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def test_align_train_refuses_a_reserved_mask_token_before_any_launcher(maskless_verifier, tmp_path, capsys, started):
    eos = AutoTokenizer.from_pretrained(maskless_verifier).eos_token_id
    common = ["recipes/tiny/dflash.yaml", f"verifier.path={maskless_verifier}", f"train.out={tmp_path / 'run'}"]
    assert main(["train", *common, f"dflash.mask_token_id={eos}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("align train: error: dflash.mask_token_id:") and len(err.splitlines()) == 1, err
    assert started == [] and not (tmp_path / "run").exists()


def test_a_dflash_drafter_for_a_tokenizer_without_a_mask_token_is_built_and_decodes_losslessly(maskless_verifier,
                                                                                               tmp_path, started):
    # Before: validate passed, and `align train` stopped once the launcher and DeepSpeed had started ("dflash: the
    # tokenizer of ... has no mask token"). Now the preflight passes, and the drafter train builds uses the choice.
    args = ["recipes/tiny/dflash.yaml", f"verifier.path={maskless_verifier}", f"train.out={tmp_path / 'run'}"]
    assert main(["train", *args]) == 0 and started == ["train"]
    recipe = load_recipe(args[0], args[1:])
    chosen, how = dflash_mask_token(recipe)
    # The tokens added to the tiny tokenizer have no embedding rows (ids past the verifier's 8192): the unused special
    # token below them is <|mask|>, no longer the tokenizer's mask token.
    assert AutoTokenizer.from_pretrained(maskless_verifier).convert_ids_to_tokens(chosen) == "<|mask|>", how
    torch.manual_seed(0)
    drafter, spec = new_dflash_drafter(recipe.verifier, recipe.dflash, recipe.drafter, chosen, gamma=4)
    assert drafter.config.mask_token_id == spec.mask_token_id == chosen
    verifier = AutoModelForCausalLM.from_pretrained(maskless_verifier, dtype=torch.float32).eval()
    prompt = torch.tensor([AutoTokenizer.from_pretrained(maskless_verifier)("def add(a, b):").input_ids])
    expected, _ = ar_generate(verifier, prompt, 16)
    assert specdiff_generate(verifier, drafter.eval(), spec, prompt, 4, 16)[0] == expected
