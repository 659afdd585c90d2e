"""Benchmarks as eval prompts, laid out as on the Hub (HumanEval, GSM8K's configs) or as Spec-Bench's question.jsonl:
a dataset config, a category filter, the first turn of a multi-turn question, and each prompt's stable id (#14 item 5).

Offline: each source is built in tmp_path in its Hub repository's layout (a README whose metadata names the configs,
data/<config>/<split>-*.parquet), with the real column schemas; `datasets` reads a Hub id and such a folder the same
way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from align.cli import main
from align.config import RecipeError
from align.data import PromptRow, eval_prompt_rows, prompt_id, prompt_ids_sha256
from align.recipe_files import load_recipe

# Three rows of each benchmark, their fields as published (long fields shortened).
HUMANEVAL = [
    {"task_id": "HumanEval/0", "prompt": "from typing import List\n\n\ndef has_close_elements(numbers: List[float], "
     "threshold: float) -> bool:\n", "entry_point": "has_close_elements",
     "canonical_solution": "    for idx, elem in enumerate(numbers):\n", "test": "\n\ndef check(candidate):\n"},
    {"task_id": "HumanEval/1", "prompt": "from typing import List\n\n\ndef separate_paren_groups(paren_string: str) "
     "-> List[str]:\n", "entry_point": "separate_paren_groups", "canonical_solution": "    result = []\n",
     "test": "\n\ndef check(candidate):\n"},
    {"task_id": "HumanEval/2", "prompt": "\n\ndef truncate_number(number: float) -> float:\n",
     "entry_point": "truncate_number", "canonical_solution": "    return number % 1.0\n",
     "test": "\n\ndef check(candidate):\n"},
]
GSM8K = [
    {"question": "Janet’s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for "
     "her friends every day with four.", "answer": "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n#### 18"},
    {"question": "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in total does it "
     "take?", "answer": "It takes 2/2=<<2/2=1>>1 bolt of white fiber\n#### 3"},
    {"question": "Josh decides to try flipping a house.  He buys a house for $80,000 and then puts in $50,000 in "
     "repairs.", "answer": "The cost of the house and repairs came out to 80,000+50,000=$<<80000+50000=130000>>130,000"
     "\n#### 70000"},
]
SPEC_BENCH = [
    {"question_id": 81, "category": "writing", "turns": [
        "Compose an engaging travel blog post about a recent trip to Hawaii.",
        "Rewrite your previous response. Start every sentence with the letter A."]},
    {"question_id": 121, "category": "coding", "turns": [
        "Develop a Python program that reads all the text files under a directory and returns the top-5 words.",
        "Can you parallelize it?"]},
    {"question_id": 161, "category": "translation", "turns": [
        "Translate German to English: Pfandhäuser boomen in Singapur , da die Krise in der Mittelschicht ankommt"]},
    {"question_id": 111, "category": "math", "turns": [
        "The vertices of a triangle are at points (0, 0), (-1, 1), and (3, 3). What is the area of the triangle?",
        "What's area of the circle circumscribing the triangle?"]},
]


def hub_folder(root: Path, configs: dict[str, dict[str, list[dict]]]) -> Path:
    """A dataset repository as on the Hub: config -> split -> rows, as <config>/<split>-00000-of-00001.parquet,
    with the README metadata that declares the configs (as openai/gsm8k's and openai/openai_humaneval's do)."""
    from datasets import Dataset

    lines = ["---", "configs:"]
    for config, splits in configs.items():
        (root / config).mkdir(parents=True)
        lines += [f"- config_name: {config}", "  data_files:"]
        for split, rows in splits.items():
            Dataset.from_list(rows).to_parquet(str(root / config / f"{split}-00000-of-00001.parquet"))
            lines += [f"  - split: {split}", f"    path: {config}/{split}-*"]
    (root / "README.md").write_text("\n".join([*lines, "---", ""]))
    return root


@pytest.fixture(scope="module")
def benchmarks(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("benchmarks")
    spec_bench = root / "question.jsonl"
    spec_bench.write_text("".join(json.dumps(r) + "\n" for r in SPEC_BENCH))
    return {
        "humaneval": hub_folder(root / "openai_humaneval", {"openai_humaneval": {"test": HUMANEVAL}}),
        # GSM8K has two configs, so a config must be named; socratic's rows here are main's reversed
        "gsm8k": hub_folder(root / "gsm8k", {"main": {"test": GSM8K, "train": GSM8K[:1]},
                                             "socratic": {"test": GSM8K[::-1]}}),
        "spec_bench": spec_bench,
    }


def rows_of(*overrides: str) -> list[PromptRow]:
    return eval_prompt_rows(load_recipe(None, list(overrides)))


def test_humaneval_prompts_with_their_task_ids(benchmarks):
    rows = rows_of(f"eval.prompts={benchmarks['humaneval']}")  # split test and column prompt: the defaults
    assert [r.prompt for r in rows] == [r["prompt"] for r in HUMANEVAL]
    assert [r.id for r in rows] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"] and [r.row for r in rows] == [0, 1, 2]
    # A named id column wins over the usual ones; a missing one is refused naming its key.
    assert [r.id for r in rows_of(f"eval.prompts={benchmarks['humaneval']}", "eval.id_field=entry_point")] == \
        [r["entry_point"] for r in HUMANEVAL]
    with pytest.raises(RecipeError, match="eval.id_field: .* has no 'number' field"):
        rows_of(f"eval.prompts={benchmarks['humaneval']}", "eval.id_field=number")


def test_gsm8k_by_its_config_name(benchmarks):
    gsm8k = benchmarks["gsm8k"]
    main_rows = rows_of(f"eval.prompts={gsm8k}", "eval.dataset_config=main", "eval.prompt_column=question")
    assert [r.prompt for r in main_rows] == [r["question"] for r in GSM8K]
    assert all(r.id is None for r in main_rows)  # no id column: reports use the sha256 of the token ids
    socratic = rows_of(f"eval.prompts={gsm8k}", "eval.dataset_config=socratic", "eval.prompt_column=question")
    assert [r.prompt for r in socratic] == [r["question"] for r in GSM8K[::-1]]
    assert [r.prompt for r in rows_of(f"eval.prompts={gsm8k}", "eval.dataset_config=main", "eval.split=train",
                                      "eval.prompt_column=question")] == [GSM8K[0]["question"]]
    with pytest.raises(RecipeError, match=r"eval.dataset_config: .*gsm8k needs one \(configs: main, socratic\)"):
        rows_of(f"eval.prompts={gsm8k}", "eval.prompt_column=question")
    with pytest.raises(RecipeError, match=r"eval.dataset_config: .*gsm8k has no config 'mian' \(configs: main, socr"):
        rows_of(f"eval.prompts={gsm8k}", "eval.dataset_config=mian", "eval.prompt_column=question")
    with pytest.raises(RecipeError, match=r"eval.dataset_config: .*question.jsonl is a single file, which has no"):
        rows_of(f"eval.prompts={benchmarks['spec_bench']}", "eval.dataset_config=main", "eval.prompt_column=turns")


def test_spec_bench_categories_first_turns_and_question_ids(benchmarks):
    source = f"eval.prompts={benchmarks['spec_bench']}"
    rows = rows_of(source, "eval.prompt_column=turns")
    assert [r.prompt for r in rows] == [r["turns"][0] for r in SPEC_BENCH]  # a multi-turn question: its first turn
    assert [r.id for r in rows] == ["81", "121", "161", "111"]
    picked = rows_of(source, "eval.prompt_column=turns", "eval.categories=[math, coding]")
    assert [(r.id, r.row) for r in picked] == [("121", 1), ("111", 3)]  # dataset order, rows as in the file
    assert [r.id for r in rows_of(source, "eval.prompt_column=turns", "eval.categories=[math, coding]",
                                  "eval.num_prompts=1")] == ["121"]
    with pytest.raises(RecipeError, match=r"eval.categories: .* holds no prompts in roleplay \(categories: coding, "
                                          r"math, translation, writing\)"):
        rows_of(source, "eval.prompt_column=turns", "eval.categories=[roleplay]")
    with pytest.raises(RecipeError, match="eval.categories: .* has no 'category' field"):
        rows_of(f"eval.prompts={benchmarks['humaneval']}", "eval.categories=[coding]")


def test_a_prompt_without_a_dataset_id_is_named_by_its_token_ids():
    assert prompt_id(PromptRow("x", 0, "HumanEval/7"), [1, 2]) == "HumanEval/7"
    sha = prompt_id(PromptRow("x", 0), [1, 2])
    assert sha == "sha256:" + prompt_ids_sha256([[1, 2]])[:16] and sha != prompt_id(PromptRow("x", 0), [2, 1])


@pytest.mark.slow
def test_eval_reports_the_benchmark_ids_and_refuses_a_bad_config_before_work(toy_family, benchmarks, tmp_path,
                                                                            capsys):
    root, _ = toy_family
    ck = root / "ck"
    base = ["eval", "recipes/tiny/eval.yaml", f"verifier.path={ck / 'verifier'}", f"drafter.path={ck / 'drafter-base'}",
            f"ar_drafter.path={ck / 'ar-drafter'}", f"data.dir={root / 'data'}", "decode.max_new_tokens=6",
            "eval.warmup=0", "eval.methods=[specdiff]", "eval.sampling_temperature=0"]
    out = tmp_path / "out"
    assert main([*base, f"eval.out={out}", f"eval.prompts={benchmarks['spec_bench']}", "eval.prompt_column=turns",
                 "eval.categories=[coding, math]"]) == 0
    result = json.loads((out / "eval.json").read_text())
    for m in result["methods"].values():
        assert [(r["index"], r["row"], r["id"]) for r in m["records"]] == [(0, 1, "121"), (1, 3, "111")]
    capsys.readouterr()
    assert main([*base, f"eval.out={tmp_path / 'bad'}", f"eval.prompts={benchmarks['gsm8k']}",
                 "eval.prompt_column=question"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "eval.dataset_config:" in err and "configs: main, socratic" in err
    assert not (tmp_path / "bad").exists()
