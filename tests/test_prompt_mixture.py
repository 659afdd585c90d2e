"""Training prompts from several sources with weights (data.train_prompts as a list, issue 36 item 4): each source
read as `datasets.load_dataset` reads it (config name, data files, split, column), trajectories.num_prompts drawn by
weight and interleaved, refusals naming the source, the mixture recorded in the trajectories' manifest and the card,
and one name for the prompts' column in every section."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from align.cards import training_data, training_prompts_line
from align.cli import main
from align.config import RecipeError
from align.data import check_prompts, load_prompt_rows, mixture_counts
from align.recipe_files import load_recipe

from conftest import checkout_env

ROOT = Path(__file__).resolve().parents[1]
VERIFIER = ROOT / "checkpoints" / "tiny" / "verifier"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """A JSONL file of 30 `prompt` rows, and a Hub-layout folder with two configs (`math`, `code`) whose rows hold
    the prompt in `question`, in a `train` and a `test` split."""
    from datasets import Dataset

    root = tmp_path_factory.mktemp("mixture")
    (root / "plain.jsonl").write_text("".join(json.dumps({"prompt": f"plain {i}"}) + "\n" for i in range(30)))
    hub = root / "hub"
    for config in ("math", "code"):
        for split in ("train", "test"):
            (hub / config).mkdir(parents=True, exist_ok=True)
            Dataset.from_list([{"question": f"{config} {split} {i}"} for i in range(12)]).to_parquet(
                str(hub / config / f"{split}-00000-of-00001.parquet"))
    (hub / "README.md").write_text("---\nconfigs:\n" + "".join(
        f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train-*\n"
        f"  - split: test\n    path: {c}/test-*\n" for c in ("math", "code")) + "---\n")
    return {"plain": root / "plain.jsonl", "hub": hub}


def mixture(sources: dict[str, Path], *overrides: str, total: int = 16) -> list[str]:
    return [f"data.train_prompts=[{{path: {sources['plain']}, weight: 3}}, "
            f"{{path: {sources['hub']}, name: code, split: test, prompt_column: question}}]",
            f"trajectories.num_prompts={total}", *overrides]


def test_shares_follow_the_weights_and_sum_to_the_total():
    assert mixture_counts(16, [3, 1]) == [12, 4]
    assert mixture_counts(10, [1, 1, 1]) == [4, 3, 3]  # the remainder to the earlier source
    for total, weights in [(2560, [0.5, 0.3, 0.2]), (7, [5, 1]), (1, [1, 1])]:
        counts = mixture_counts(total, weights)
        assert sum(counts) == total
        assert all(abs(c - total * w / sum(weights)) < 1 for c, w in zip(counts, weights))


def test_a_mixture_draws_each_sources_share_interleaved(sources):
    rows = load_prompt_rows(load_recipe(None, mixture(sources)), "data.train_prompts")
    assert [r.prompt for r in rows if r.source == 0] == [f"plain {i}" for i in range(12)]
    assert [r.prompt for r in rows if r.source == 1] == [f"code test {i}" for i in range(4)]  # config, split, column
    # Interleaved: every quarter of the prompts (a chunk of trajectories, the held-out ones) has both sources at 3:1.
    for quarter in range(4):
        assert Counter(r.source for r in rows[quarter * 4 : quarter * 4 + 4]) == {0: 3, 1: 1}


def test_a_source_reads_only_its_data_files(sources):
    recipe = load_recipe(None, [f"data.train_prompts=[{{path: {sources['hub']}, data_files: math/train-*, "
                                "prompt_column: question}, {path: " + f"{sources['plain']}}}]",
                                "trajectories.num_prompts=4"])
    assert [r.prompt for r in load_prompt_rows(recipe, "data.train_prompts")] == [
        "math train 0", "plain 0", "math train 1", "plain 1"]


@pytest.mark.parametrize("overrides, message", [
    (["trajectories.num_prompts=null"], r"^trajectories\.num_prompts: a mixture .* draws this many prompts by weight"),
    (["trajectories.num_prompts=60"], r"^data\.train_prompts\[0\]: .*plain\.jsonl holds 30 prompts, fewer than its "
                                      r"share of trajectories\.num_prompts \(45 of 60\)"),
])
def test_a_mixture_that_cannot_be_drawn_is_refused_naming_the_key(sources, overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_prompt_rows(load_recipe(None, [*mixture(sources), *overrides]), "data.train_prompts")


@pytest.mark.parametrize("source, message", [
    ("{path: PLAIN, weight: 1000}, {path: PLAIN, weight: 0.001}", r"^data\.train_prompts\[1\]\.weight: 0\.001 gives it "
                                                                  r"none of the 16 prompts"),
    ("{path: PLAIN}, {path: HUB, name: poetry, prompt_column: question}", r"^data\.train_prompts\[1\]\.name: .* has no "
                                                                          r"config 'poetry' \(configs: .*math"),
    ("{path: PLAIN}, {path: HUB, name: code, split: dev, prompt_column: question}",
     r"^data\.train_prompts\[1\]\.split: .* has no split 'dev'"),
    ("{path: PLAIN}, {path: HUB, name: code}", r"^data\.prompt_column: .* has no 'prompt' field \(fields: question\)"),
    ("{path: PLAIN}, {path: HUB, name: code, prompt_column: text}", r"^data\.train_prompts\[1\]\.prompt_column: .* "
                                                                    r"has no 'text' field"),
    ("{path: PLAIN, revision: v1.0}", r"^data\.train_prompts\[0\]\.revision: .* is local"),
    ("{path: PLAIN, data_files: x.jsonl}", r"^data\.train_prompts\[0\]\.data_files: .* is a single file"),
    ("{path: PLAIN}, {path: missing.jsonl}", r"^data\.train_prompts\[1\]: no such file: missing\.jsonl"),
])
def test_a_bad_source_is_refused_naming_its_entry(sources, source, message):
    value = source.replace("PLAIN", str(sources["plain"])).replace("HUB", str(sources["hub"]))
    recipe = load_recipe(None, [f"data.train_prompts=[{value}]", "trajectories.num_prompts=16"])
    with pytest.raises(RecipeError, match=message):
        load_prompt_rows(recipe, "data.train_prompts")


def test_chat_messages_without_a_template_name_the_source(tmp_path, sources):
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"hi {i}"}]}) + "\n" for i in range(8)))
    recipe = load_recipe(None, [f"data.train_prompts=[{{path: {sources['plain']}}}, {{path: {chat}}}]",
                                "trajectories.num_prompts=8", f"verifier.path={VERIFIER}", "data.chat_template=off"])
    with pytest.raises(RecipeError, match=r"^data\.train_prompts\[1\]: .*chat\.jsonl holds chat messages, which need "
                                          r"a chat template \(data\.chat_template=off\)"):
        check_prompts(recipe, "data.train_prompts", "verifier.path")


def test_the_old_column_key_is_refused_with_its_new_name():
    for section in ("eval", "calibrate"):
        with pytest.raises(RecipeError, match=rf"^'{section}\.prompt_field' is now '{section}\.prompt_column': rename"):
            load_recipe(None, [f"{section}.prompt_field=question"])
    done = subprocess.run([sys.executable, "-m", "align", "validate", "recipes/tiny/eval.yaml", "eval.prompt_field=q"],
                          cwd=ROOT, capture_output=True, text=True, env=checkout_env(), timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "'eval.prompt_field' is now 'eval.prompt_column'" in done.stderr


def test_trajectories_of_a_mixture_record_it(tmp_path, sources, one_thread):
    out = tmp_path / "traj"
    assert main(["trajectories", "recipes/tiny/align.yaml", *mixture(sources, total=8), f"trajectories.out={out}",
                 f"verifier.path={VERIFIER}", "trajectories.max_new_tokens=2", "trajectories.batch_size=8"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(s["path"], s["name"], s["split"], s["prompt_column"], s["weight"], s["num_prompts"])
            for s in manifest["prompts"]] == [(str(sources["plain"]), None, None, None, 3.0, 6),
                                              (str(sources["hub"]), "code", "test", "question", 1.0, 2)]
    assert manifest["rows"] == 8
    # The card names every source and its share (a Hub id among them goes into its `datasets` metadata).
    meta = {"recipe": {"data": {"train_prompts": [*manifest["prompts"], {"path": "org/chat", "weight": 4.0}]}}}
    data = training_data(meta)
    assert [d.hub_id for d in data] == [None, None, "org/chat"]
    line = training_prompts_line(data)
    assert "`plain.jsonl` (a local file, sha256" in line and "(38% of them)" in line and "(50% of them)" in line
