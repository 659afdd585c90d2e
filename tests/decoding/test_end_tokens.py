"""One end-token rule: trajectories stop where eval's decoding stops, at the tokenizer's eos and at every end token
of the verifier's generation_config (an instruct model's end-of-turn token: Gemma 3-it's <end_of_turn> beside <eos>),
and the manifest says which; training refuses trajectories that stopped elsewhere."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from align.cli import main
from align.config import RecipeError
from align.data import check_trajectories_match, eos_token_ids, generation_config_of, load_trajectories
from align.decoding.ar import ar_generate
from align.decoding.generation import Sampling
from align.models import load_verifier
from align.recipe_files import load_recipe

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "checkpoints" / "tiny" / "tokenizer"
# Prompts of different lengths: HF's batches are left-padded.
PROMPTS = ["def add(a, b):\n    return", "import os\n", "class Stack:\n    def push(self, item):\n        self.",
           "x = [i * i for i in range("]
NEW_TOKENS = 16


def greedy(model, ids, eos_ids):
    return ar_generate(model, torch.tensor([ids]), NEW_TOKENS, Sampling(), frozenset(eos_ids))[0]


@pytest.fixture(scope="module")
def instruct_like(tmp_path_factory, one_thread):
    """A tiny random Llama whose generation_config ends generations at a token other than the tokenizer's eos: one its
    greedy completion of the first prompt writes first at position `stop_at`, before NEW_TOKENS. Returns its folder,
    tokenizer, the prompts' token ids, that token and `stop_at`."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None)).eval()
    prompt_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS]
    first = greedy(model, prompt_ids[0], {tokenizer.eos_token_id})
    stop_at = next(i for i in range(1, NEW_TOKENS - 1) if first[i] not in first[:i] + [tokenizer.eos_token_id])
    stop = first[stop_at]
    folder = tmp_path_factory.mktemp("instruct") / "verifier"
    model.generation_config.eos_token_id = [stop]  # the end-of-turn token; the tokenizer's eos is another
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, tokenizer, prompt_ids, stop, stop_at


def trajectories(verifier, out, prompts, *extra):
    return main(["trajectories", "recipes/tiny/align.yaml", f"verifier.path={verifier}", f"trajectories.out={out}",
                 f"data.train_prompts={prompts}", "trajectories.temperature=0", "trajectories.batch_size=4",
                 "trajectories.completions_per_prompt=1", f"trajectories.max_new_tokens={NEW_TOKENS}",
                 "verifier.dtype=float32", "data.chat_template=off", *extra])


@pytest.fixture(scope="module")
def made(instruct_like, tmp_path_factory):
    folder, *_ = instruct_like
    root = tmp_path_factory.mktemp("traj")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    assert trajectories(folder, root / "hf", prompts, "trajectories.backend=hf") == 0
    return root, prompts


def test_the_rule_reads_generation_config_and_the_tokenizer_with_or_without_the_weights(instruct_like):
    folder, tokenizer, _, stop, _ = instruct_like
    loaded = load_verifier(load_recipe(None, [f"verifier.path={folder}", "verifier.dtype=float32"]).verifier)
    assert eos_token_ids(loaded, tokenizer) == {stop, tokenizer.eos_token_id}
    # From the files (vLLM's trajectories load no HF model): the same ids from_pretrained's model gives.
    assert eos_token_ids(generation_config_of(str(folder)), tokenizer) == eos_token_ids(loaded, tokenizer)
    # Without generation_config.json, from_pretrained builds one from config.json: so does the rule.
    bare = folder.parent / "bare"
    shutil.copytree(folder, bare)
    (bare / "generation_config.json").unlink()
    assert eos_token_ids(generation_config_of(str(bare)), tokenizer) == {tokenizer.eos_token_id}
    # A list with the tokenizer's eos in it again: deduplicated.
    loaded.generation_config.eos_token_id = [tokenizer.eos_token_id, stop, stop]
    assert sorted(eos_token_ids(loaded, tokenizer)) == sorted({stop, tokenizer.eos_token_id})


def test_trajectories_stop_where_eval_greedy_stops(instruct_like, made):
    folder, tokenizer, prompt_ids, stop, stop_at = instruct_like
    root, _ = made
    rows = load_trajectories(root / "hf")
    assert rows["prompt_ids"] == prompt_ids
    # Eval's AR greedy decoding of the loaded verifier, with eval's end tokens.
    verifier = load_verifier(load_recipe(None, [f"verifier.path={folder}", "verifier.dtype=float32"]).verifier)
    eval_ids = eos_token_ids(verifier, tokenizer)
    expected = [greedy(verifier, ids, eval_ids) for ids in prompt_ids]
    assert rows["completion_ids"] == expected  # token for token
    assert len(first := rows["completion_ids"][0]) < NEW_TOKENS and first[-1] == stop  # kept, ended early
    assert len(first) == stop_at + 1
    manifest = json.loads((root / "hf" / "manifest.json").read_text())
    assert manifest["settings"]["end_token_ids"] == sorted(eval_ids) == manifest["end_token_ids"]


def test_training_refuses_trajectories_that_stopped_elsewhere(instruct_like, made):
    folder, tokenizer, _, stop, _ = instruct_like
    root, _ = made
    recipe = load_recipe("recipes/tiny/align.yaml", [f"verifier.path={folder}", f"trajectories.out={root / 'hf'}",
                                                      "trajectories.temperature=0", "data.chat_template=off",
                                                      f"trajectories.max_new_tokens={NEW_TOKENS}"])
    manifest = json.loads((root / "hf" / "manifest.json").read_text())
    check_trajectories_match(recipe, manifest)  # the same end tokens: accepted
    # Made before the end tokens were recorded: they stopped at the tokenizer's eos only, which is not this rule.
    old = {**manifest, "settings": {k: v for k, v in manifest["settings"].items() if k != "end_token_ids"}}
    with pytest.raises(RecipeError, match="stopped at the tokenizer's eos only.*rerun align trajectories"):
        check_trajectories_match(recipe, old)
    other = {**manifest, "settings": {**manifest["settings"], "end_token_ids": [tokenizer.eos_token_id]}}
    with pytest.raises(RecipeError, match=rf"stopped at the end tokens \[{tokenizer.eos_token_id}\].*ends generations"):
        check_trajectories_match(recipe, other)
