"""The tiny family's corpus (the Python standard library's source) and its HumanEval-shaped prompt sets.

Every machine with Python has this corpus, so the embedded default needs no download. Files are split into
train / validation / test by a hash of their path (deterministic, and stable when files are added or removed).
A prompt is a function's signature and docstring; the completion is its body, as in HumanEval. Training prompts come
from train files only, evaluation prompts from test files only.
"""

from __future__ import annotations

import ast
import hashlib
import json
import platform
import sys
import sysconfig
import textwrap
from pathlib import Path
from typing import Iterator

from align.disk import atomic_file, mark_folder, write_text_atomic

SPLITS: tuple[str, ...] = ("train", "validation", "test")
# Folders of the stdlib that are not "the library": its own tests (near-duplicates of library code, and the test
# split must be unseen code) and third-party packages.
SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"}
MAX_PROMPT_CHARS = 1500
MAX_COMPLETION_CHARS = 1500


def split_of(relpath: str) -> str:
    """train (90%), validation (5%) or test (5%), by a hash of the path relative to the stdlib root."""
    bucket = int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) % 100
    return "train" if bucket < 90 else "validation" if bucket < 95 else "test"


def stdlib_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """(relative path, absolute path) of the running interpreter's stdlib .py files, tests left out, sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if SKIPPED_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        found.append((rel.as_posix(), path))
    return sorted(found)


def read_corpus(fraction: float = 1.0, root: Path | None = None) -> dict[str, list[dict[str, str]]]:
    """{split: [{"path", "text"}]} of the stdlib. `fraction` < 1 keeps a deterministic subset of files."""
    corpus: dict[str, list[dict[str, str]]] = {s: [] for s in SPLITS}
    for rel, path in stdlib_files(root):
        if fraction < 1.0 and int(hashlib.sha256(b"keep:" + rel.encode()).hexdigest()[:8], 16) % 10_000 >= fraction * 10_000:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a handful of stdlib files are latin-1 test fixtures; they teach nothing worth the exception
        corpus[split_of(rel)].append({"path": rel, "text": text})
    return corpus


def corpus_hash(corpus: dict[str, list[dict[str, str]]]) -> str:
    digest = hashlib.sha256()
    for split in SPLITS:
        for row in corpus[split]:
            digest.update(f"{split}\0{row['path']}\0".encode())
            digest.update(row["text"].encode())
    return digest.hexdigest()


def extract_prompts(relpath: str, text: str) -> Iterator[dict[str, str]]:
    """HumanEval-shaped tasks from one module: functions (and methods, dedented) that have a docstring and a body."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    lines = text.splitlines(keepends=True)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
            continue
        doc, body = node.body[0], node.body[1:]
        if not body or node.end_lineno is None or doc.end_lineno is None:
            continue
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
        source = textwrap.dedent("".join(lines[start : node.end_lineno]))
        prompt_lines = doc.end_lineno - start
        source_lines = source.splitlines(keepends=True)
        prompt, completion = "".join(source_lines[:prompt_lines]), "".join(source_lines[prompt_lines:])
        # One-line bodies (`pass`, `raise NotImplementedError`, `return self._x`) test nothing worth drafting.
        if sum(1 for line in completion.splitlines() if line.strip()) < 2:
            continue
        if len(prompt) > MAX_PROMPT_CHARS or len(completion) > MAX_COMPLETION_CHARS:
            continue
        yield {"task_id": f"stdlib/{relpath}:{node.lineno}:{node.name}", "prompt": prompt, "canonical_solution": completion}


def prompt_sets(corpus: dict[str, list[dict[str, str]]]) -> dict[str, list[dict[str, str]]]:
    """{"train": [...], "test": [...]}: tasks from train files and from test files."""
    return {split: [t for row in corpus[split] for t in extract_prompts(row["path"], row["text"])] for split in ("train", "test")}


def write_jsonl(rows: list[dict], path: Path) -> None:
    """Write atomically: a reader never sees a half-written prompt file, and ranks writing at once do not collide."""
    with atomic_file(path) as tmp, tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def read_manifest(folder: Path) -> dict | None:
    """folder/manifest.json, or None when it is missing or unreadable."""
    try:
        return json.loads((Path(folder) / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def build_data(data_dir: Path, corpus: dict[str, list[dict[str, str]]], fraction: float) -> str:
    """Write `corpus` (read_corpus(fraction): read, and checked by the caller, before anything is written) as
    `datasets` JSONL splits, and its prompt sets, under data_dir unless the folder already holds this very corpus;
    return its hash."""
    digest = corpus_hash(corpus)
    manifest = read_manifest(data_dir)
    if manifest is None or manifest.get("corpus_hash") != digest:
        mark_folder(data_dir, "data")
        for split in SPLITS:
            write_jsonl(corpus[split], data_dir / "corpus" / f"{split}.jsonl")
        prompts = prompt_sets(corpus)
        for split, rows in prompts.items():
            write_jsonl(rows, data_dir / "prompts" / f"{split}.jsonl")
        # The manifest goes last: its presence means the folder is complete.
        write_text_atomic(data_dir / "manifest.json", json.dumps({
            "corpus_hash": digest,
            "source": f"Python {platform.python_version()} standard library",
            "files": {s: len(corpus[s]) for s in SPLITS},
            "chars": {s: sum(len(r["text"]) for r in corpus[s]) for s in SPLITS},
            "prompts": {s: len(r) for s, r in prompts.items()},
            "corpus_fraction": fraction,
        }, indent=2))
    return digest


def ensure_data(data_dir: str | Path, fraction: float = 1.0, model_dir: str | Path | None = None) -> Path:
    """data_dir, built from the running interpreter's stdlib on first use (about 5 s), so that a fresh clone runs
    every stage on the tiny family without `align bootstrap`. When `model_dir` has a manifest naming the corpus it was
    trained on and this interpreter's corpus differs (another Python version), say so: the test split may then
    overlap the model's training data."""
    data_dir = Path(data_dir)
    if not (data_dir / "manifest.json").is_file():
        print(f"align: building the tiny corpus and prompt sets from the Python standard library into {data_dir}",
              file=sys.stderr)
        build_data(data_dir, read_corpus(fraction), fraction)
    if model_dir is not None:
        trained_on = (read_manifest(model_dir) or {}).get("corpus_hash")
        built = read_manifest(data_dir) or {}
        if trained_on and trained_on != built.get("corpus_hash"):
            print(f"align: warning: {data_dir} was built from {built.get('source')}, not the corpus {model_dir} was "
                  "trained on; its test prompts may overlap that model's training data", file=sys.stderr)
    return data_dir
