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
