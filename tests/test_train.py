"""`deepspeed align/train.py`: 1 and 2 processes, ZeRO 0 and 3, exact resume after SIGKILL, NaN guard, LoRA/full."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from align.cli import main as align

ROOT = Path(__file__).resolve().parents[1]
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")


@pytest.fixture(scope="module")
def trajectories(toy_trajectories):
    return toy_trajectories


def overrides(trajectories, out, *extra):
    root, traj = trajectories
    return [f"drafter.path={root / 'ck' / 'drafter-base'}", f"verifier.path={root / 'ck' / 'verifier'}",
            f"trajectories.out={traj}", f"train.out={out}", "train.gamma=4", "train.windows_per_sequence=2",
            "train.lr=3e-3", "train.warmup_steps=0", "train.eval_every=100", "train.final_eval_prompts=0", *extra]


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def launch(processes, args, wait=True):
    if processes == 1:
        cmd = [sys.executable, "align/train.py", "recipes/tiny/align.yaml", *args]
    else:
        cmd = [DEEPSPEED, "--num_gpus", str(processes), "--master_port", str(29500 + os.getpid() % 1000),
               "align/train.py", "recipes/tiny/align.yaml", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    if not wait:
        return proc
    output = proc.communicate(timeout=600)[0]
    return proc.returncode, output


def losses(out):
    by_step = {}
    for line in (Path(out) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record["loss"]  # a resumed run rewrites steps after its checkpoint
    return [by_step[s] for s in sorted(by_step)]


def test_two_processes_and_zero3_match_one_process(trajectories, tmp_path):
    one = tmp_path / "one"
    rc, log = launch(1, overrides(trajectories, one, "train.max_steps=4", "train.micro_batch_size=2",
                                  "train.gradient_accumulation_steps=2"))
    assert rc == 0, log[-3000:]
    for zero in (0, 3):
        two = tmp_path / f"two-zero{zero}"
        rc, log = launch(2, overrides(trajectories, two, "train.max_steps=4", "train.micro_batch_size=2",
                                      f"train.zero_stage={zero}"))
        assert rc == 0, log[-3000:]
        assert losses(two) == pytest.approx(losses(one), rel=1e-4, abs=1e-6), zero
    # The merged checkpoints agree too.
    a = AutoModelForCausalLM.from_pretrained(one / "step_4")
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "two-zero3" / "step_4")
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-5), name


def test_sigkill_after_a_checkpoint_resumes_with_the_same_losses(trajectories, tmp_path):
    args = ["train.max_steps=24", "train.save_every=3", "train.micro_batch_size=2"]
    full = tmp_path / "full"
    rc, log = launch(1, overrides(trajectories, full, *args))
    assert rc == 0, log[-3000:]
    killed = tmp_path / "killed"
    proc = launch(1, overrides(trajectories, killed, *args), wait=False)
    latest = killed / "ds_state" / "latest"
    deadline = time.time() + 300
    while not latest.is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # as soon as the first checkpoint is on disk
    proc.wait()
    tag = latest.read_text().strip()
    assert tag != "step_24" and (killed / tag).is_dir()  # killed mid-run, after a checkpoint
    rc, log = launch(1, overrides(trajectories, killed, *args))
    assert rc == 0 and "resuming from step" in log, log[-3000:]
    assert losses(killed) == pytest.approx(losses(full), rel=1e-5, abs=1e-7)


def test_non_finite_loss_stops_with_the_last_checkpoint_intact(trajectories, tmp_path):
    out = tmp_path / "nan"
    # An absurd learning rate without clipping blows the weights up after the first step.
    rc, log = launch(1, overrides(trajectories, out, "train.max_steps=5", "train.save_every=1", "train.lr=1e30",
                                  "train.grad_clip=0", "train.micro_batch_size=2"))
    assert rc == 3 and "not finite" in log, log[-3000:]
    saved = sorted(p.name for p in out.glob("step_*"))
    assert saved and "step_5" not in saved
    AutoModelForCausalLM.from_pretrained(out / saved[-1])  # loadable, not half-written


@pytest.mark.parametrize("lora", [0, 4])
def test_lora_and_full_fine_tuning_save_loadable_merged_folders(trajectories, tmp_path, lora):
    root, _ = trajectories
    out = tmp_path / f"lora{lora}"
    rc, log = launch(1, overrides(trajectories, out, "train.max_steps=2", f"train.lora_r={lora}",
                                  "train.micro_batch_size=2", "train.losses={streak: 1.0, fkl: 0.5}",
                                  "train.data_mode=online", "train.eval_every=2", "train.final_eval_prompts=2"))
    assert rc == 0, log[-3000:]
    merged = AutoModelForCausalLM.from_pretrained(out / "step_2")
    base = AutoModelForCausalLM.from_pretrained(root / "ck" / "drafter-base")
    assert set(merged.state_dict()) == set(base.state_dict())  # no LoRA keys left: plain transformers loads it
    changed = [n for n, p in merged.named_parameters() if not torch.allclose(p.float(), base.state_dict()[n].float())]
    assert changed
    meta = json.loads((out / "step_2" / "meta.json").read_text())
    assert meta["step"] == 2 and "expected_streak" in meta["metrics"] and "fkl" in meta["metrics"]
    assert meta["final_tau"] >= 1.0 and meta["final_tau_prompts"] == 2  # real τ with the runtime at the end
    assert merged.config.drafter_spec["attention"] == "block_causal"


def test_gkd_baseline_distils_the_ar_drafter(trajectories, tmp_path):
    root, traj = trajectories
    out = tmp_path / "gkd"
    assert align(["gkd", "recipes/tiny/align.yaml", f"verifier.path={root / 'ck' / 'verifier'}",
                  f"ar_drafter.path={root / 'ck' / 'ar-drafter'}", f"trajectories.out={traj}", f"gkd.out={out}",
                  "gkd.max_steps=3", "gkd.batch_size=4", "gkd.max_new_tokens=6", "gkd.lr=1e-2"]) == 0
    distilled = AutoModelForCausalLM.from_pretrained(out / "final")
    base = AutoModelForCausalLM.from_pretrained(root / "ck" / "ar-drafter")
    assert any(not torch.allclose(p.float(), q.float()) for p, q in zip(distilled.parameters(), base.parameters()))
    log = json.loads((out / "final" / "meta.json").read_text())["log"]
    assert any("loss" in entry for entry in log)


def test_on_policy_mode_trains(trajectories, tmp_path):
    out = tmp_path / "on_policy"
    rc, log = launch(1, overrides(trajectories, out, "train.max_steps=2", "train.micro_batch_size=2",
                                  "train.data_mode=on_policy", "train.losses={ce_streak: 1.0, tvd: 1.0}"))
    assert rc == 0, log[-3000:]
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 2 and record["tvd"] > 0 and record["ce_streak"] > 0
