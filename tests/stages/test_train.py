"""`deepspeed align/train.py`: 1 and 2 processes, ZeRO 0 and 3, exact resume after SIGKILL, NaN guard, LoRA/full."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import TOY_TRAJECTORIES, checkout_env

from align.cli import main as align
from align.launch import free_port
from align.data import rank_share
from align.dist import warn_stale_build_locks

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this file out; CI runs it

ROOT = Path(__file__).resolve().parents[2]
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")


@pytest.fixture(scope="module")
def trajectories(toy_trajectories):
    return toy_trajectories


def overrides(trajectories, out, *extra):
    root, traj = trajectories
    return [f"drafter.path={root / 'ck' / 'drafter-base'}", f"verifier.path={root / 'ck' / 'verifier'}",
            f"trajectories.out={traj}", *TOY_TRAJECTORIES, f"train.out={out}", "train.gamma=4", "train.windows_per_sequence=2",
            "train.lr=3e-3", "train.warmup_steps=0", "train.eval_every=100", "train.final_eval_prompts=0", *extra]


def env():
    # The ranks run this checkout's align/train.py: it must import this checkout's align, not the installed one.
    return checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")


def launch(processes, args, wait=True):
    if processes == 1:
        cmd = [sys.executable, "align/train.py", "recipes/tiny/align.yaml", *args]
    else:
        cmd = [DEEPSPEED, "--num_gpus", str(processes), "--master_port", str(free_port()),
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


def test_the_deepspeed_script_runs_the_align_of_its_own_checkout(tmp_path):
    # `deepspeed align/train.py` from a second clone must run that clone's align, not the one installed in the
    # environment (here the editable install of this checkout, which PYTHONPATH no longer names).
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "align", clone / "align", ignore=shutil.ignore_patterns("__pycache__"))
    cli = clone / "align" / "cli.py"
    future = "from __future__ import annotations\n"
    cli.write_text(cli.read_text().replace(future, future + "print(\"the clone's cli\", flush=True)\n", 1))
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(clone / "align" / "train.py"), "--help"], cwd=tmp_path,
                          env=environment, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("the clone's cli\nusage: align train"), proc.stdout[:300]


def test_two_processes_and_zero3_match_one_process(trajectories, tmp_path):
    one = tmp_path / "one"
    rc, log = launch(1, overrides(trajectories, one, "train.max_steps=4", "train.micro_batch_size=2",
                                  "train.gradient_accumulation_steps=2"))
    assert rc == 0, log[-3000:]
    for zero in (0, 3):
        two = tmp_path / f"two-zero{zero}"
        # ZeRO-3's ranks with a batch worker each, forked once their process group is up (as on a GPU by default).
        rc, log = launch(2, overrides(trajectories, two, "train.max_steps=4", "train.micro_batch_size=2",
                                      f"train.zero_stage={zero}", f"train.batch_workers={int(zero == 3)}"))
        assert rc == 0, log[-3000:]
        assert losses(two) == pytest.approx(losses(one), rel=1e-4, abs=1e-6), zero
    # The merged checkpoints agree too.
    a = AutoModelForCausalLM.from_pretrained(one / "step_4")
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "two-zero3" / "step_4")
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-5), name


def test_zero_offload_from_your_deepspeed_config_trains_as_one_process(trajectories, tmp_path):
    # train.deepspeed_config (issue 36): ZeRO-Offload of the optimizer state and ZeRO-3 parameters to the CPU, for
    # real, on 2 ranks: the same losses as one process without DeepSpeed's partitioning.
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"offload_optimizer": {"device": "cpu"},
                                                    "offload_param": {"device": "cpu"}}}))
    one, two = tmp_path / "one", tmp_path / "offload"
    rc, log = launch(1, overrides(trajectories, one, "train.max_steps=3", "train.micro_batch_size=2",
                                  "train.gradient_accumulation_steps=2"))
    assert rc == 0, log[-3000:]
    rc, log = launch(2, overrides(trajectories, two, "train.max_steps=3", "train.micro_batch_size=2",
                                  "train.zero_stage=3", f"train.deepspeed_config={ds}"))
    assert rc == 0, log[-3000:]
    assert "ZeRO-3 offloads its optimizer state and parameters to the CPU" in log, log[-3000:]
    assert losses(two) == pytest.approx(losses(one), rel=1e-4, abs=1e-6)


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


# A run whose recipe sets an update far beyond any sane learning rate. The schema refuses such a learning rate, so
# the driver sets it after validation, on purpose: the first step's loss is finite and its update makes every weight
# non-finite, which is what the guard must catch before anything is published.
POISON = """
import sys
from align.recipe_files import load_recipe
from align.stages.train import main
recipe = load_recipe(sys.argv[1], sys.argv[2:])
recipe = recipe.model_copy(update={"train": recipe.train.model_copy(update={"lr": float("inf")})})
sys.exit(main(recipe, "poison"))
"""


# align train with its verifier loads counted and the final τ asked, as it starts, whether an engine is still alive.
WATCHED_FINAL_TAU = """
import gc, json, sys
import deepspeed
import align.stages.train as train

loads, real_load, real_tau = [], train.load_verifier, train.final_tau
def load_verifier(section):
    loads.append(section.path)
    return real_load(section)
def final_tau(*args, **kwargs):
    gc.collect()
    engines = sum(issubclass(type(o), deepspeed.DeepSpeedEngine) for o in gc.get_objects())
    record = real_tau(*args, **kwargs)
    print("FINAL_TAU " + json.dumps({"engines": engines, "verifier_loads": len(loads)}), flush=True)
    return record
train.load_verifier, train.final_tau = load_verifier, final_tau
from align.cli import main
raise SystemExit(main(["train", *sys.argv[1:]]))
"""


@pytest.mark.parametrize("data_mode", ["online", "offline"])
def test_the_final_tau_runs_once_the_engine_is_released_and_borrows_the_steps_verifier(trajectories, tmp_path,
                                                                                       data_mode):
    """The final τ loads a merged drafter and runs the verifier: with the engine (drafter, optimiser state, ZeRO's
    buffers) still alive beside them, rank 0 holds two drafters; an online run's verifier is lent, not loaded again."""
    args = overrides(trajectories, tmp_path / "out", "train.max_steps=2", "train.micro_batch_size=2",
                     f"train.data_mode={data_mode}", "train.final_eval_prompts=1",
                     *(["train.losses={streak: 1.0, fkl: 0.5}"] if data_mode == "online" else []))
    proc = subprocess.run([sys.executable, "-c", WATCHED_FINAL_TAU, "recipes/tiny/align.yaml", *args], cwd=ROOT,
                          env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    seen = json.loads(proc.stdout.split("FINAL_TAU ")[1].splitlines()[0])
    assert seen == {"engines": 0, "verifier_loads": 1}
    assert "final_tau" in json.loads((tmp_path / "out" / "step_2" / "meta.json").read_text())


def finite_weights(folder):
    from safetensors.torch import load_file

    return all(torch.isfinite(t).all() for t in load_file(folder / "model.safetensors").values())


def test_an_update_that_poisons_the_weights_is_never_checkpointed(trajectories, tmp_path):
    out = tmp_path / "nan"
    args = overrides(trajectories, out, "train.max_steps=5", "train.save_every=1", "train.grad_clip=0",
                     "train.micro_batch_size=2")
    proc = subprocess.run([sys.executable, "-c", POISON, "recipes/tiny/align.yaml", *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 3 and "step 1 gave a non-finite loss or non-finite weights" in log, log[-3000:]
    assert not list(out.glob("step_*")) and not (out / "ds_state" / "latest").exists()  # nothing poisoned published


def test_the_weights_check_waits_for_the_device_once_a_step(monkeypatch):
    """weights_finite reads one flag for every parameter (a host sync each would stall a GPU step hundreds of times),
    and still finds the one non-finite weight."""
    from types import SimpleNamespace

    from align.stages.train import weights_finite

    reads = []
    for name in ("__bool__", "item", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _name=name: (reads.append(_name),
                                                                                           _real(self, *a))[1])
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(30)])
    engine = SimpleNamespace(module=model, device=torch.device("cpu"))
    assert weights_finite(engine, 1) and len(reads) == 1
    with torch.no_grad():
        model[17].bias[2] = float("nan")
    reads.clear()
    assert not weights_finite(engine, 1) and len(reads) == 1


def test_batches_built_ahead_by_workers_train_as_the_loop_builds_them(trajectories, tmp_path):
    """train.batch_workers: two worker processes build the steps' micro-batches ahead (each every other step) and
    the run is the one whose loop builds each batch when it needs it: the same losses and streaks, step by step."""
    runs = {}
    for workers in (0, 2):
        out = tmp_path / f"workers-{workers}"
        rc, log = launch(1, overrides(trajectories, out, "train.max_steps=5", "train.micro_batch_size=2",
                                      "train.gradient_accumulation_steps=2", f"train.batch_workers={workers}",
                                      "train.eval_every=5", "train.save_every=5"))
        assert rc == 0, log[-3000:]
        runs[workers] = [{k: v for k, v in json.loads(line).items() if k != "tokens_per_s_per_rank"}
                         for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in runs[2]] == [1, 2, 3, 4, 5]
    assert runs[2] == runs[0]


def test_a_resume_keeps_one_metrics_row_per_step(trajectories, tmp_path):
    out = tmp_path / "replayed"
    args = overrides(trajectories, out, "train.max_steps=4", "train.save_every=2", "train.micro_batch_size=2",
                     "train.eval_every=2")
    rc, log = launch(1, args)
    assert rc == 0, log[-3000:]
    # As if the run had died after logging steps 3-4 but before their checkpoint: the rerun replays them.
    (out / "ds_state" / "latest").write_text("step_2")
    rc, log = launch(1, args)
    assert rc == 0 and "resuming from step 2" in log, log[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


@pytest.mark.parametrize("override, key", [("trajectories.temperature=0.9", "trajectories.temperature"),
                                           ("trajectories.max_new_tokens=64", "trajectories.max_new_tokens")])
def test_trajectories_made_otherwise_are_refused(trajectories, tmp_path, capsys, override, key):
    assert align(["train", "recipes/tiny/align.yaml", *overrides(trajectories, tmp_path / "x"), override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"align train: error: {key}: the trajectories in") and "\n" not in err
    assert not (tmp_path / "x").exists()


def test_trajectories_of_another_verifier_are_refused(trajectories, tmp_path, capsys):
    root, _ = trajectories
    other = tmp_path / "other-verifier"
    shutil.copytree(root / "ck" / "verifier", other)
    assert align(["train", "recipes/tiny/align.yaml", *overrides(trajectories, tmp_path / "x"),
                  f"verifier.path={other}"]) == 2
    assert capsys.readouterr().err.startswith("align train: error: verifier.path: the trajectories in")


def test_gamma_longer_than_every_completion_is_refused(trajectories, tmp_path, capsys):
    assert align(["train", "recipes/tiny/align.yaml", *overrides(trajectories, tmp_path / "x"),
                  "train.gamma=40"]) == 2
    assert "train.gamma: 40 is longer than every completion" in capsys.readouterr().err


@pytest.mark.parametrize("count, world", [(5, 2), (4, 2), (7, 3), (1, 4)])
def test_every_rank_gets_the_same_number_of_held_out_rows(count, world):
    indices = list(range(100, 100 + count))
    shares = [rank_share(indices, rank, world) for rank in range(world)]
    assert len({len(rows) for rows, _ in shares}) == 1  # the same number of collective forwards on every rank
    assert sorted(i for rows, weights in shares for i, w in zip(rows, weights) if w) == indices  # each row once


@pytest.mark.parametrize("lora", [0, 4])
def test_lora_and_full_fine_tuning_save_loadable_folders(trajectories, tmp_path, lora):
    root, _ = trajectories
    out = tmp_path / f"lora{lora}"
    rc, log = launch(1, overrides(trajectories, out, "train.max_steps=2", f"train.lora_r={lora}",
                                  "train.micro_batch_size=2", "train.losses={streak: 1.0, fkl: 0.5}",
                                  "train.data_mode=online", "train.eval_every=2", "train.final_eval_prompts=2"))
    assert rc == 0, log[-3000:]
    if lora:  # the adapter, merged into its base when read (the round trip: tests/stages/test_lora_checkpoints.py)
        from align.config import DrafterSection
        from align.models import load_ar_drafter

        assert not (out / "step_2" / "model.safetensors").exists()
        merged = load_ar_drafter(DrafterSection(path=str(out / "step_2")))
    else:
        merged = AutoModelForCausalLM.from_pretrained(out / "step_2")
    base = AutoModelForCausalLM.from_pretrained(root / "ck" / "drafter-base")
    assert set(merged.state_dict()) == set(base.state_dict())  # no LoRA keys left
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
                  f"ar_drafter.path={root / 'ck' / 'ar-drafter'}", f"trajectories.out={traj}", *TOY_TRAJECTORIES, f"gkd.out={out}",
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


def test_the_newer_losses_train_together(trajectories, tmp_path):
    """D-PACE, DFlash's position decay and the Left-to-Right losses in one real step: each is logged, finite and
    non-zero (the drafter-base's argmax drafts are wrong somewhere, so the first-error term has a position to train;
    chain, a negative log expected length, is negative)."""
    out = tmp_path / "newer"
    names = ("position_decay_ce", "dpace", "positional_ce", "first_error_focal", "chain")
    rc, log = launch(1, overrides(trajectories, out, "train.max_steps=1", "train.micro_batch_size=2",
                                  "train.losses={" + ", ".join(f"{n}: 1.0" for n in names) + "}"))
    assert rc == 0, log[-3000:]
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert all(math.isfinite(record[n]) and record[n] != 0 for n in names) and record["chain"] < 0, record
    # The rate the step used (no warm-up: the peak), not the next step's (0 after the last: the cosine's end).
    assert record["lr"] == 3e-3, record


def test_a_build_lock_left_by_a_killed_build_is_named_before_deepspeed_waits_on_it(tmp_path, monkeypatch, capsys):
    # A killed deepspeed_shm_comm build left its lock and the next CPU run hung, silently, in this project's own CI.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "building_now").mkdir()
    stale, fresh = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "building_now" / "lock"
    stale.touch()
    fresh.touch()  # another rank compiling at this moment: not stale
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    assert warn_stale_build_locks() == [stale]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "60 min old" in err[0] and f"delete {stale.parent}" in err[0]



def test_a_resume_on_another_number_of_ranks_is_refused_and_a_raised_max_steps_takes_effect_at_once(trajectories,
                                                                                                     tmp_path, capsys):
    """ZeRO keeps an optimizer shard per rank, and DeepSpeed reloads them on as many ranks only: resuming on another
    number is refused in one line that says the state is complete and how to go on (it used to call the state
    "damaged; delete it"), with nothing touched. Resumed on its own number with train.max_steps raised, the first
    resumed step runs at the new cosine schedule's rate (it ran at the old one's end, 0.0)."""
    out = tmp_path / "run"
    args = overrides(trajectories, out, "train.save_every=1", "train.micro_batch_size=2", "train.zero_stage=2")
    rc, log = launch(1, [*args, "train.max_steps=2"])
    assert rc == 0, log[-3000:]
    before = {p: p.read_bytes() for p in sorted((out / "ds_state").rglob("*")) if p.is_file()}
    # Before launching (align train --num_gpus 2), and on each rank of a launch started by hand
    assert align(["train", "recipes/tiny/align.yaml", *args, "train.max_steps=4", "--num_gpus", "2"]) == 2
    said = capsys.readouterr().err.strip()
    rc, log = launch(2, [*args, "train.max_steps=4"])
    assert rc != 0 and "this launch has 2" in log, log[-3000:]
    assert said.startswith("align train: error: train.out: ") and "\n" not in said
    assert "saved step 2 on 1 ranks" in said and "this launch has 2" in said and "complete" in said
    assert "delete" not in said
    assert {p: p.read_bytes() for p in sorted((out / "ds_state").rglob("*")) if p.is_file()} == before
    rc, log = launch(1, [*args, "train.max_steps=4"])
    assert rc == 0 and "resuming from step 2" in log, log[-3000:]
    records = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    # warm-up 0: lr · ½(1 + cos(π·step/max_steps)) at step index 2 of 4 and 3 of 4
    assert records[3]["lr"] == pytest.approx(3e-3 * 0.5)
    assert records[4]["lr"] == pytest.approx(3e-3 * 0.5 * (1 + math.cos(math.pi * 3 / 4)))
