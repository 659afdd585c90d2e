"""train.cache_verifier_states (align/drafters/states_cache.py): a DFlash run's verifier states, computed once per
trajectory and read by its later epochs, train exactly as recomputing them does."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from align.drafters.states_cache import FILLED_FILE, STATES_FILE, StatesCache, batch_states

ROOT = Path(__file__).resolve().parents[2]


def test_rows_are_computed_once_and_read_back_exactly(tmp_path):
    lengths, width = [3, 5, 2], 4
    StatesCache(tmp_path, lengths, width, torch.bfloat16).create()
    cache = StatesCache(tmp_path, lengths, width, torch.bfloat16).open()
    states = torch.randn(3, 6, width).to(torch.bfloat16)  # what the verifier gives for rows 0, 1, 2 (padded to 6)
    clean_ids = torch.zeros(3, 6, dtype=torch.long)
    calls = []

    def compute(ids):
        calls.append(len(ids))
        return states[:len(ids)] if len(ids) == 3 else states[[1]]

    first = batch_states(cache, [0, 1, 2], clean_ids, compute)
    for row, length in enumerate(lengths):  # each row's own tokens, zeros past them
        assert torch.equal(first[row, :length], states[row, :length]) and not first[row, length:].any()
    assert calls == [3]
    again = StatesCache(tmp_path, lengths, width, torch.bfloat16).open()  # another rank's maps
    assert torch.equal(batch_states(again, [2, 0], clean_ids[:2], compute), first[[2, 0]])
    assert calls == [3]  # read, not computed
    fresh = StatesCache(tmp_path, lengths, width, torch.bfloat16)
    fresh.create()  # a new launch starts empty
    assert fresh.open().get(0) is None
    fresh.remove()
    assert not (tmp_path / STATES_FILE).exists() and not (tmp_path / FILLED_FILE).exists()


@pytest.mark.slow
def test_two_ranks_train_the_same_with_cached_states_and_remove_them(toy_trajectories, tmp_path):
    """24 steps of 4 rows over 2 ranks pass two epochs of the toy trajectories: the later steps read states another
    rank computed, and the losses equal those of a run that recomputes them (fp32: to rounding), a KD loss's too
    (its verifier logits from the cached final states)."""
    from align.launch import free_port
    from conftest import TOY_TRAJECTORIES, checkout_env

    root, traj = toy_trajectories
    losses = {}
    for cached in (False, True):
        out = tmp_path / f"run-{cached}"
        args = [f"verifier.path={root / 'ck' / 'verifier'}", f"trajectories.out={traj}", *TOY_TRAJECTORIES,
                f"data.dir={root / 'data'}", f"train.out={out}", "train.gamma=4", "train.windows_per_sequence=4",
                "train.max_steps=24", "train.micro_batch_size=2", "train.eval_every=100", "train.save_every=24",
                "train.final_eval_prompts=0", "train.losses={ce_streak: 1.0, fkl: 1.0}", "dflash.aux_layer_ids=[0]",
                "dflash.intermediate_size=48", f"train.cache_verifier_states={str(cached).lower()}"]
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port",
               str(free_port()), "align/train.py", "recipes/tiny/dflash.yaml", *args]
        done = subprocess.run(cmd, cwd=ROOT, env=checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"),
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
        losses[cached] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert not (out / STATES_FILE).exists() and not (out / FILLED_FILE).exists()
    assert len(losses[True]) == 24
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)
