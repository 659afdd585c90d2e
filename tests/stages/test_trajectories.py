"""`align trajectories`: resumable, checksummed, spread over ranks."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from align.cli import main
from align.config import RecipeError
from align.data import load_trajectories

ROOT = Path(__file__).resolve().parents[2]


def args(root, out, *extra):
    return ["trajectories", "recipes/tiny/align.yaml", f"verifier.path={root / 'ck' / 'verifier'}",
            f"data.dir={root / 'data'}", f"trajectories.out={out}", "trajectories.num_prompts=6",
            "trajectories.batch_size=2", "trajectories.completions_per_prompt=2", "trajectories.temperature=0.5",
            "trajectories.max_new_tokens=8",
            *extra]


@pytest.fixture(scope="module")
def made(toy_family, tmp_path_factory):
    root, _ = toy_family
    out = tmp_path_factory.mktemp("traj")
    assert main(args(root, out, "trajectories.store_topk=3")) == 0
    return root, out


def test_rows_and_manifest(made):
    _, out = made
    data = load_trajectories(out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(data) == 12 == manifest["rows"] and len(manifest["chunks"]) == 3
    assert sorted(set(data["prompt_index"])) == list(range(6))
    row = data[0]
    assert 1 <= len(row["completion_ids"]) <= 8 and len(row["topk_ids"]) == len(row["completion_ids"])
    assert all(len(k) == 3 for k in row["topk_ids"])
    assert manifest["completion_tokens"] == sum(len(c) for c in data["completion_ids"])
    # Top-k as float16 log-probs and int32 ids (Arrow types), and where every completion could stop.
    assert str(data.features["topk_logprobs"]) == "List(List(Value('float16')))"
    assert str(data.features["topk_ids"]) == "List(List(Value('int32')))"
    assert manifest["topk_dtypes"] == {"ids": "int32", "logprobs": "float16"}
    assert manifest["end_token_ids"] == manifest["settings"]["end_token_ids"] == [0]  # the toy tokenizer's eos only


def test_resume_redoes_only_missing_chunks(made):
    root, out = made
    chunks = out / "chunks"
    before = {p.name: (p / "chunk.json").stat().st_mtime_ns for p in chunks.iterdir()}
    import shutil

    shutil.rmtree(chunks / "chunk-00001")
    assert main(args(root, out, "trajectories.store_topk=3")) == 0
    after = {p.name: (p / "chunk.json").stat().st_mtime_ns for p in chunks.iterdir()}
    assert after["chunk-00000"] == before["chunk-00000"] and after["chunk-00002"] == before["chunk-00002"]
    assert after["chunk-00001"] != before["chunk-00001"]
    assert len(load_trajectories(out)) == 12


def test_other_settings_are_refused_into_the_same_folder(made, capsys):
    root, out = made
    capsys.readouterr()
    assert main(args(root, out, "trajectories.temperature=0.9")) == 2
    assert "holds trajectories made with other settings" in capsys.readouterr().err


def test_a_corrupted_chunk_is_named(made, tmp_path):
    _, out = made
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    arrow = next((copy / "chunks" / "chunk-00002").glob("*.arrow"))
    data = bytearray(arrow.read_bytes())
    data[len(data) // 2] ^= 0xFF
    arrow.write_bytes(bytes(data))
    with pytest.raises(RecipeError, match=f"{arrow}.*corrupted"):
        load_trajectories(copy)


@pytest.mark.slow
def test_two_ranks_split_the_chunks(toy_family, tmp_path):
    root, _ = toy_family
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "two"
    # Through the real DeepSpeed launcher, as `align trajectories recipe.yaml --num_gpus 2` runs it.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "align", *map(str, args(root, out)), "--num_gpus", "2",
                             "--master_port", str(port)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--module align.cli trajectories" in result.stdout
    assert len(load_trajectories(out)) == 12
    # The same prompts and seeds make the same completions as one process would.
    single = tmp_path / "one"
    assert main(args(root, single)) == 0
    assert load_trajectories(out)["completion_ids"] == load_trajectories(single)["completion_ids"]


def greedy_args(root, out, *extra):
    return args(root, out, "trajectories.temperature=0", "trajectories.completions_per_prompt=1", *extra)


@pytest.fixture(scope="module")
def greedy(toy_family, tmp_path_factory):
    """Greedy trajectories of the 6 prompts, no cap: the reference the capped and split runs are compared with."""
    root, _ = toy_family
    out = tmp_path_factory.mktemp("greedy")
    assert main(greedy_args(root, out)) == 0
    data = load_trajectories(out)
    return root, {p: (list(ids), list(c)) for p, ids, c in zip(data["prompt_index"], data["prompt_ids"],
                                                               data["completion_ids"])}, out


def test_chunks_are_cut_longest_first_and_long_prompts_left_out_counted(greedy, tmp_path, capsys):
    from datasets import load_from_disk

    root, reference, out = greedy
    written = [len(ids) for chunk in sorted((out / "chunks").iterdir()) for ids in load_from_disk(str(chunk))[
        "prompt_ids"]]
    lengths = [len(reference[p][0]) for p in range(6)]
    assert written == sorted(lengths, reverse=True) != lengths  # chunk 0 holds the longest prompts ...
    assert load_trajectories(out)["prompt_index"] == list(range(6))  # ... and the data reads in prompt order
    cap = sorted(lengths)[2]  # leaves out the prompts longer than the third shortest
    capsys.readouterr()
    assert main(greedy_args(root, tmp_path / "capped", f"trajectories.max_prompt_tokens={cap}")) == 0
    left_out = sum(n > cap for n in lengths)
    assert f"{left_out} of 6 prompts left out, longer than trajectories.max_prompt_tokens={cap}" in \
        capsys.readouterr().out
    manifest = json.loads((tmp_path / "capped" / "manifest.json").read_text())
    assert manifest["prompts_left_out"] == {"longer_than_max_prompt_tokens": left_out}
    capped = load_trajectories(tmp_path / "capped")
    # The prompts kept keep their place in data.train_prompts (the held-out split reads it) and their completions.
    assert sorted(capped["prompt_index"]) == sorted(p for p, (ids, _) in reference.items() if len(ids) <= cap)
    for p, ids, completion in zip(capped["prompt_index"], capped["prompt_ids"], capped["completion_ids"]):
        assert (list(ids), list(completion)) == reference[p]

    assert main(greedy_args(root, tmp_path / "none", f"trajectories.max_prompt_tokens={min(lengths) - 1}")) == 2
    err = capsys.readouterr().err.strip()
    assert f"all 6 prompts are longer than {min(lengths) - 1} tokens" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "none").exists()


def limited_memory(monkeypatch, rows_that_fit: int) -> list[int]:
    """The verifier's generate() raises CUDA's out-of-memory error for batches of more than `rows_that_fit` rows, as
    a GPU would for a batch too long; returns the batch sizes tried."""
    import torch

    import align.stages.trajectories as trajectories

    tried, load = [], trajectories.load_verifier

    def load_limited(section):
        verifier = load(section)
        generate = verifier.generate

        def limited(*args, **kwargs):
            rows = kwargs["input_ids"].shape[0] * kwargs.get("num_return_sequences", 1)
            tried.append(rows)
            if rows > rows_that_fit:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
            return generate(*args, **kwargs)

        verifier.generate = limited
        return verifier

    monkeypatch.setattr(trajectories, "load_verifier", load_limited)
    return tried


def test_a_batch_out_of_memory_is_retried_in_halves_and_said(greedy, tmp_path, monkeypatch, capsys):
    root, reference, _ = greedy
    tried = limited_memory(monkeypatch, rows_that_fit=1)
    capsys.readouterr()
    assert main(greedy_args(root, tmp_path / "split", "trajectories.batch_size=3")) == 0
    assert tried == [3, 1, 2, 1, 1] * 2  # each chunk of 3: tried whole, then 1 + 2, and the 2 as 1 + 1
    assert capsys.readouterr().out.count("prompts (the longest") == 4
    manifest = json.loads((tmp_path / "split" / "manifest.json").read_text())
    assert manifest["out_of_memory_splits"] == 4 and manifest["rows"] == 6
    split = load_trajectories(tmp_path / "split")
    for p, ids, completion in zip(split["prompt_index"], split["prompt_ids"], split["completion_ids"]):
        assert (list(ids), list(completion)) == reference[p]  # greedy: the split batches decode the same


def test_one_prompt_that_does_not_fit_is_refused_naming_the_cap(greedy, tmp_path, monkeypatch, capsys):
    root, _, _ = greedy
    limited_memory(monkeypatch, rows_that_fit=0)
    capsys.readouterr()
    assert main(greedy_args(root, tmp_path / "oom")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "trajectories.max_prompt_tokens: chunk 0: one prompt of" in err and "runs out of memory" in err
