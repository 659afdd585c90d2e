"""What each rank hashes (issue 51, item 1), counted on 2 CPU ranks with $ALIGN_HASH_LOG: a save's DeepSpeed state is
hashed by the ranks as they write it and never read back; a resume's state and the weights the run started from are
hashed once, by the process that checks before launching (align's launcher) or, under deepspeed started by hand, by
local rank 0 alone, never by every rank."""

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from conftest import TOY_TRAJECTORIES
from test_multi_node import DEEPSPEED, env, free_port, run_all

from align.disk import CHECKSUMS, file_sha256

ALIGN = str(Path(sys.executable).parent / "align")


def hashed(log_dir: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(log_dir.glob("*.jsonl")) for line in f.read_text().splitlines()]


def under(records: list[dict], folder: Path, how: str) -> list[dict]:
    folder = str(folder.resolve())
    return [r for r in records if r["how"] == how and r["path"].startswith(folder + "/")]


def train(cmd_head: list[str], trajectories, out: Path, steps: int, log_dir: Path) -> None:
    root, traj = trajectories
    log_dir.mkdir()
    args = ["recipes/tiny/align.yaml", f"drafter.path={root / 'ck' / 'drafter-base'}",
            f"verifier.path={root / 'ck' / 'verifier'}", f"trajectories.out={traj}", *TOY_TRAJECTORIES,
            f"train.out={out}", "train.gamma=4", "train.windows_per_sequence=2", "train.warmup_steps=0",
            "train.eval_every=100", "train.final_eval_prompts=0", f"train.max_steps={steps}", "train.save_every=2",
            "train.micro_batch_size=2", "train.zero_stage=3"]
    [(status, log)] = run_all([([*cmd_head, *args], env(ALIGN_HASH_LOG=str(log_dir)))])
    assert status == 0, log[-3000:]


@pytest.mark.slow  # three 2-rank DeepSpeed runs
def test_each_file_is_hashed_once_as_it_is_written_and_once_a_machine_on_resume(toy_trajectories, tmp_path):
    out = tmp_path / "run"
    launcher = [ALIGN, "train", "--num_gpus", "2"]

    # A new run saving at step 2: every file of the DeepSpeed tag hashed by the rank that wrote it, none read back.
    train(launcher, toy_trajectories, out, 2, tmp_path / "save")
    tag = out / "ds_state" / "step_2"
    record = json.loads((tag / CHECKSUMS).read_text())
    assert any("optim_states" in name for name in record) and len(record) >= 3, record
    assert record == {name: file_sha256(tag / name) for name in record}  # the digests taken while writing are right
    records = hashed(tmp_path / "save")
    written = under(records, tag, "written")
    assert sorted(Path(r["path"]).name for r in written) == sorted(record)
    assert {r["rank"] for r in written} == {"0", "1"}  # each rank its own optimizer shard
    assert under(records, tag, "read") == []
    # the step folder's weights (a streamed ZeRO-3 save, into the folder's temporary twin) hashed as written too;
    # rank 0 reads back its small files alone
    step = [r for r in records if Path(r["path"]).parent.name in ("step_2", ".step_2.tmp") and "/ds_state/" not in r["path"]]
    assert [(r["rank"], Path(r["path"]).name) for r in step if r["how"] == "written"] == [("0", "model.safetensors")]
    assert {r["rank"] for r in step} == {"0"} and {Path(r["path"]).suffix for r in step if r["how"] == "read"} == {".json"}

    # Inputs (the drafter's folder, the trajectories) hashed by the launching process (no RANK) alone, but for
    # rank 0's one hash of the weights it records in run.json.
    root, traj = toy_trajectories
    drafter = root / "ck" / "drafter-base"
    assert {r["rank"] for r in under(records, traj, "read")} == {None}
    assert Counter(r["rank"] for r in under(records, drafter, "read") if r["path"].endswith(".safetensors")) == \
        {None: 1, "0": 1}

    # Resumed by align's launcher: its check hashes the tag, the weights and the data once; the ranks hash none again.
    train(launcher, toy_trajectories, out, 4, tmp_path / "resume")
    records = hashed(tmp_path / "resume")
    read = under(records, tag, "read")
    assert Counter(Path(r["path"]).name for r in read) == Counter(record.keys())  # every file once
    assert {r["rank"] for r in read} == {None}
    for folder in (drafter, traj):
        assert {r["rank"] for r in under(records, folder, "read")} == {None}
    assert under(records, out / "ds_state" / "step_4", "read") == []

    # Resumed by deepspeed started by hand: local rank 0 checks, rank 1 reads what it checked.
    cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "align/train.py"]
    train(cmd, toy_trajectories, out, 6, tmp_path / "by-hand")
    records = hashed(tmp_path / "by-hand")
    tag4 = out / "ds_state" / "step_4"
    read = under(records, tag4, "read")
    assert Counter(Path(r["path"]).name for r in read) == Counter(json.loads((tag4 / CHECKSUMS).read_text()).keys())
    assert {r["rank"] for r in read} == {"0"}
    for folder in (drafter, traj):
        once = under(records, folder, "read")
        assert {r["rank"] for r in once} == {"0"} and len(once) == len({r["path"] for r in once})
