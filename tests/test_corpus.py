"""The tiny corpus: deterministic file-level splits, and HumanEval-shaped prompts from test files only."""

import json
from pathlib import Path

from align.corpus import ensure_data, extract_prompts, prompt_sets, read_corpus, split_of, stdlib_files

MODULE = '''\
import os


def add(a, b):
    """Add two numbers."""
    total = a + b
    return total


def no_doc(x):
    return x


class Box:
    @staticmethod
    def make(size):
        """Make a box."""
        box = Box()
        box.size = size
        return box

    def trivial(self):
        """Nothing to complete."""
        pass
'''


def test_split_is_deterministic_and_proportioned():
    paths = [rel for rel, _ in stdlib_files()]
    assert [split_of(p) for p in paths] == [split_of(p) for p in paths]
    counts = {s: sum(split_of(p) == s for p in paths) for s in ("train", "validation", "test")}
    assert counts["train"] > 0.8 * len(paths) and counts["validation"] > 0 and counts["test"] > 0


def test_test_folders_are_left_out():
    for rel, _ in stdlib_files():
        parts = Path(rel).parts
        assert "test" not in parts[:-1] and "tests" not in parts[:-1] and not parts[-1].startswith("test_")


def test_extract_prompts_splits_signature_and_body():
    tasks = list(extract_prompts("m.py", MODULE))
    names = [t["task_id"].rsplit(":", 1)[1] for t in tasks]
    assert names == ["add", "make"]  # no docstring and one-line bodies are skipped
    add = tasks[0]
    assert add["prompt"] == 'def add(a, b):\n    """Add two numbers."""\n'
    assert add["canonical_solution"] == "    total = a + b\n    return total\n"
    make = tasks[1]
    assert make["prompt"].startswith("@staticmethod\ndef make(size):")  # methods are dedented, decorators kept
    compile(make["prompt"] + make["canonical_solution"], "make", "exec")


def test_prompt_sets_come_from_their_own_split(tmp_path):
    for split in ("a", "b", "c", "d", "e", "f", "g", "h"):
        (tmp_path / f"{split}.py").write_text(MODULE)
    corpus = read_corpus(root=tmp_path)
    prompts = prompt_sets(corpus)
    for split in ("train", "test"):
        files = {row["path"] for row in corpus[split]}
        assert all(t["task_id"].split(":")[0].removeprefix("stdlib/") in files for t in prompts[split])


def test_ensure_data_builds_on_first_use_and_warns_on_another_corpus(tmp_path, capsys):
    data_dir = ensure_data(tmp_path / "data", fraction=0.05)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    assert manifest["prompts"]["train"] > 0
    assert sum(1 for _ in (data_dir / "prompts" / "train.jsonl").open()) == manifest["prompts"]["train"]
    assert "building the tiny corpus" in capsys.readouterr().err
    # Already built: left alone, and a model trained on this corpus draws no warning.
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "manifest.json").write_text(json.dumps({"corpus_hash": manifest["corpus_hash"]}))
    ensure_data(data_dir, fraction=0.05, model_dir=tmp_path / "model")
    assert capsys.readouterr().err == ""
    (tmp_path / "model" / "manifest.json").write_text(json.dumps({"corpus_hash": "another"}))
    ensure_data(data_dir, fraction=0.05, model_dir=tmp_path / "model")
    assert "may overlap" in capsys.readouterr().err
