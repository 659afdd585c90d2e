"""`align memory` (one layer measured at the recipe's width, extrapolated per GPU) and the training keys that bound
memory: train.activation_checkpointing and train.max_sequence_length."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TOY_TRAJECTORIES, checkout_env

from align.cli import main as align
from align.config import RecipeError
from align.data import load_trajectories
from align.memory_probe import (Measured, Width, allocation_trace, drafter_width, lora_parameters, measure,
                          micro_batch_shape, per_gpu)
from align.recipe_files import load_recipe
from align.memory_probe import MEMORY_CHECKED
from align.stages.train import apply_activation_checkpointing

ROOT = Path(__file__).resolve().parents[2]
TINY = "recipes/tiny/align.yaml"


def test_allocation_trace_counts_what_work_allocates_and_keeps():
    def work():
        kept = torch.empty(1000, dtype=torch.float32)
        torch.empty(3000, dtype=torch.float32)  # freed at once: in the peak, not kept
        return kept

    peak, live, _ = allocation_trace(work)
    assert live == 4000 and peak == 16000


# ---- the extrapolation, by hand ----------------------------------------------------------------------------------
WIDTH = Width(hidden_size=100, intermediate_size=300, num_hidden_layers=10, num_attention_heads=4,
              num_key_value_heads=2, head_dim=25, vocab_size=1000, parameters=1_000_000, attention="bidirectional")
MEASURED = Measured(layer_kept=5_000, layer_peak=8_000, layer_input=1_000, head_and_losses_peak=2_000)


def recipe(*overrides):
    return load_recipe(TINY, list(overrides))


def test_per_gpu_by_hand_full_fine_tuning_zero3_bf16():
    gpu = per_gpu(recipe("train.zero_stage=3", "train.bf16=true", "memory.world_size=4"), WIDTH, MEASURED)
    assert gpu.weights == 1_000_000 * 2 // 4  # bf16 weights, sharded
    assert gpu.gradients == 1_000_000 * 4 // 4  # fp32 accumulation under ZeRO, sharded
    assert gpu.optimizer == 1_000_000 * 12 // 4  # fp32 master + two Adam moments, sharded
    layer = (1_000_000 - 1000 * 100) // 10  # 90,000 per layer; the LM head is 100,000
    assert gpu.gathered == max(layer, 100_000) * 2
    assert gpu.activations == 10 * 5_000 + max(2_000, 8_000 - 5_000)
    assert gpu.total == 500_000 + 1_000_000 + 3_000_000 + 200_000 + 53_000


def test_per_gpu_by_hand_lora_zero2_with_checkpointing():
    r = recipe("train.zero_stage=2", "train.bf16=true", "train.lora_r=2", "memory.world_size=8",
               "train.activation_checkpointing=true")
    trainable = lora_parameters(WIDTH, 2)
    # per layer: q (100+100), k (100+50), v (100+50), o (100+100), gate, up (100+300) x2, down (300+100), rank 2
    assert trainable == 10 * 2 * (200 + 150 + 150 + 200 + 400 + 400 + 400)
    gpu = per_gpu(r, WIDTH, MEASURED)
    assert gpu.weights == 2_000_000  # ZeRO-2 keeps the (frozen) weights whole on every rank
    assert gpu.gradients == trainable * 4 // 8 and gpu.optimizer == trainable * 12 // 8 and gpu.gathered == 0
    assert gpu.activations == 10 * 1_000 + max(2_000, 8_000)  # each layer keeps its input; one is recomputed


def test_per_gpu_by_hand_fp32_without_zero():
    gpu = per_gpu(recipe("train.zero_stage=0", "train.bf16=false", "memory.world_size=8"), WIDTH, MEASURED)
    assert (gpu.weights, gpu.gradients, gpu.optimizer) == (4_000_000, 4_000_000, 8_000_000)


def test_the_verifier_a_rank_holds_is_counted_for_every_mode():
    """Offline a rank holds no verifier; online or on-policy labels hold it whole (outside DeepSpeed, unsharded by
    ZeRO); a DFlash drafter holds it whole, or only its embeddings and head with precomputed states."""
    from align.memory_probe import verifier_bytes, verifier_held

    config = json.loads((ROOT / "checkpoints" / "tiny" / "verifier" / "config.json").read_text())
    whole = sum(v.numel() for v in safetensors_tensors(ROOT / "checkpoints" / "tiny" / "verifier"))
    ends = config["vocab_size"] * config["hidden_size"] * (1 if config.get("tie_word_embeddings", True) else 2)
    cases = [((), "none", 0), (("train.data_mode=on_policy",), "whole", whole),
             (("train.data_mode=online", "train.losses={fkl: 1.0}"), "whole", whole)]
    for overrides, held, params in cases:
        r = recipe(*overrides, "verifier.dtype=bfloat16", "train.zero_stage=3", "memory.world_size=4")
        assert (verifier_held(r), verifier_bytes(r)) == (held, params * 2), overrides
        gpu = per_gpu(r, WIDTH, MEASURED)
        assert gpu.verifier == params * 2 and gpu.total == gpu.weights + gpu.gradients + gpu.optimizer + \
            gpu.gathered + gpu.activations + gpu.verifier
    dflash = load_recipe("recipes/tiny/dflash.yaml", ["verifier.dtype=bfloat16"])
    assert (verifier_held(dflash), verifier_bytes(dflash)) == ("whole", whole * 2)
    precomputed = load_recipe("recipes/tiny/dflash.yaml", ["verifier.dtype=bfloat16", "states.out=/tmp/s"])
    assert verifier_held(precomputed) == "ends"
    assert ends * 2 <= verifier_bytes(precomputed) < whole * 2  # embeddings, head, the final norm's few values


def safetensors_tensors(folder):
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors").values()


# ---- the measured part -------------------------------------------------------------------------------------------
def test_the_tiny_drafters_width_is_read_from_its_config():
    width = drafter_width(recipe())
    config = json.loads((ROOT / "checkpoints" / "tiny" / "drafter-base" / "config.json").read_text())
    assert (width.hidden_size, width.num_hidden_layers, width.vocab_size) == (
        config["hidden_size"], config["num_hidden_layers"], config["vocab_size"])
    assert width.attention == config["drafter_spec"]["attention"]


def test_measured_memory_is_positive_and_grows_with_the_sequence():
    r = recipe("train.micro_batch_size=2")
    width = drafter_width(r)
    shapes = [micro_batch_shape(r, width, tokens) for tokens in (64, 256)]
    short, long = (measure(r, width, shape) for shape in shapes)
    assert 0 < short.layer_kept < long.layer_kept and short.layer_peak < long.layer_peak
    assert short.layer_kept <= short.layer_peak and short.head_and_losses_peak > 0
    # What a layer keeps grows linearly with its tokens (sdpa keeps no T x T attention).
    ratio = long.layer_kept / short.layer_kept
    assert ratio == pytest.approx(shapes[1].tokens / shapes[0].tokens, rel=0.1), ratio


def test_activation_checkpointing_and_the_cap_lower_the_peak():
    width = drafter_width(recipe())
    plain = recipe("train.micro_batch_size=2")
    measured = measure(plain, width, micro_batch_shape(plain, width, 256))
    checkpointed = recipe("train.micro_batch_size=2", "train.activation_checkpointing=true")
    assert per_gpu(checkpointed, width, measured).activations < per_gpu(plain, width, measured).activations
    capped = recipe("train.micro_batch_size=2", "train.max_sequence_length=64")
    assert micro_batch_shape(capped, width, 256).tokens == micro_batch_shape(plain, width, 64).tokens


def test_align_memory_prints_the_table_and_writes_only_when_asked(tmp_path, capsys):
    assert align(["memory", TINY, "train.micro_batch_size=1", "memory.prompt_tokens=32"]) == 0
    table = capsys.readouterr().out
    assert "kept per layer" in table and "peak" in table and "ZeRO-0 over 8 ranks" in table
    assert not list(tmp_path.iterdir())
    out = tmp_path / "memory.json"
    assert align(["memory", TINY, "train.micro_batch_size=1", "memory.prompt_tokens=32", f"memory.out={out}"]) == 0
    written = json.loads(out.read_text())
    assert written["per_gpu_bytes"]["total"] > written["measured_bytes"]["layer_kept"] > 0
    # a rerun replaces its own figures; nothing else of that name is written over: not a recipe, not a folder
    assert align(["memory", TINY, "train.micro_batch_size=1", "memory.prompt_tokens=32", f"memory.out={out}"]) == 0
    recipe = tmp_path / "r.yaml"
    recipe.write_text(Path(TINY).read_text())
    capsys.readouterr()
    for taken in (recipe, tmp_path):
        assert align(["memory", str(recipe), "train.micro_batch_size=1", f"memory.out={taken}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("align memory: error: memory.out: ") and err.count("\n") == 1
    assert recipe.read_text() == Path(TINY).read_text()


def test_a_drafter_of_unknown_width_is_refused_in_one_line(capsys):
    assert align(["memory", TINY, "drafter.path=nobody/unknown-drafter"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("align memory: error: drafter.path: nobody/unknown-drafter is neither") and \
        err.count("\n") == 1


@pytest.mark.parametrize("overrides, says", [
    # an AR model would be measured as the bidirectional drafter it is not
    (["drafter.path=checkpoints/tiny/verifier"], "drafter.path: checkpoints/tiny/verifier is not a diffusion drafter"),
    # rows past the drafter's context: measured, they described a micro-batch training never builds
    (["memory.prompt_tokens=100000"], "memory.prompt_tokens: rows of "),
    (["memory.out=README.md/memory.json"], "memory.out: README.md is a file"),
])
def test_what_memory_cannot_measure_or_write_is_refused_before_measuring(overrides, says, capsys):
    assert align(["memory", TINY, *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"align memory: error: {says}") and err.count("\n") == 1, err


def test_the_gpu_recipes_drafters_have_known_widths():
    for name, billions in (("qwen2.5-7b-diffucoder", 7.6), ("llada-8b-spiffy", 8.0), ("gemma4-diffusiongemma", 26)):
        width = drafter_width(load_recipe(f"recipes/{name}.yaml", []))
        assert width.parameters / 1e9 == pytest.approx(billions, rel=0.05), name


# ---- the training keys -------------------------------------------------------------------------------------------
def test_activation_checkpointing_is_refused_where_the_model_cannot():
    with pytest.raises(RecipeError, match="train.activation_checkpointing: the drafter .Linear. does not support"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), True)


def overrides(trajectories, out, *extra):
    root, traj = trajectories
    return [f"drafter.path={root / 'ck' / 'drafter-base'}", f"verifier.path={root / 'ck' / 'verifier'}",
            f"trajectories.out={traj}", *TOY_TRAJECTORIES, f"train.out={out}", "train.gamma=4",
            "train.windows_per_sequence=2", "train.lr=3e-3", "train.warmup_steps=0", "train.eval_every=2",
            "train.final_eval_prompts=0", "train.max_steps=2", "train.micro_batch_size=2", *extra]


def test_a_cap_that_holds_no_completion_is_refused(toy_trajectories, tmp_path, capsys):
    assert align(["train", TINY, *overrides(toy_trajectories, tmp_path / "x"), "train.max_sequence_length=2"]) == 2
    assert "train.max_sequence_length: 2 tokens hold no completion token" in capsys.readouterr().err


def _train(args):
    proc = subprocess.run([sys.executable, "align/train.py", TINY, *args], cwd=ROOT, capture_output=True, text=True,
                          env=checkout_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [json.loads(line) for line in (Path(args[[a.startswith("train.out=") for a in args].index(True)]
                                                .split("=", 1)[1]) / "metrics.jsonl").read_text().splitlines()]


def test_activation_checkpointing_trains_the_same_steps_and_the_cap_draws_fewer_windows(toy_trajectories, tmp_path):
    plain = _train(overrides(toy_trajectories, tmp_path / "plain"))
    checkpointed = _train(overrides(toy_trajectories, tmp_path / "ckpt", "train.activation_checkpointing=true"))
    assert [r["loss"] for r in checkpointed] == pytest.approx([r["loss"] for r in plain], rel=1e-5)
    assert checkpointed[-1]["expected_streak"] == pytest.approx(plain[-1]["expected_streak"], rel=1e-5)
    # A cap 3 tokens past the median prompt: windows only where a completion starts before it, none in the rest
    # (a step may then draw no window at all: its losses are 0, not 0 / 0).
    _, traj = toy_trajectories
    prompts = sorted(len(p) for p in load_trajectories(traj)["prompt_ids"])
    cap = prompts[len(prompts) // 2] + 3
    capped = _train(overrides(toy_trajectories, tmp_path / "capped", f"train.max_sequence_length={cap}"))
    assert all(c["windows"] <= p["windows"] for c, p in zip(capped, plain))
    assert sum(c["windows"] for c in capped) < sum(p["windows"] for p in plain)
    assert all(math.isfinite(c["loss"]) for c in capped)


# ---- `align train` warns before starting when the measured peak exceeds its GPU ----------------------------------
def _small_drafter(tmp_path):
    """A folder holding only a config.json at a small width: all align memory reads of a drafter."""
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "drafter_spec": {"mask_token_id": 3, "logits_shift": 0, "attention": "bidirectional"}}))
    return folder


class _FakeGpu:
    name = "Fake GPU"
    total_memory = 1_000_000  # 1 MB: less than any measured peak


def _fake_cuda(monkeypatch, probes):
    """A 1 MB CUDA device; returns align memory's measurement, which records each call in `probes`."""
    import align.memory_probe

    # setenv, not delenv: delenv of an unset name records nothing, so the "1" the check writes would outlive the test
    # and silence every later check in this process and its children. "" reads as unset.
    monkeypatch.setenv(MEMORY_CHECKED, "")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _FakeGpu())
    return lambda *a: probes.append(a) or align.memory_probe.peak_per_gpu(*a).total


def test_train_warns_once_when_the_measured_peak_exceeds_the_gpu_and_still_starts(tmp_path, monkeypatch, capsys):
    from align.memory_probe import warn_train_memory

    probes = []
    measured = _fake_cuda(monkeypatch, probes)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    r = recipe(f"drafter.path={_small_drafter(tmp_path)}", "train.micro_batch_size=2", "memory.prompt_tokens=16",
               "trajectories.max_new_tokens=16")
    assert warn_train_memory(r, measured) is None  # a warning, not a refusal
    warn_train_memory(r, measured)  # the ranks a launch starts run the checks again: they inherit that it was done
    err = capsys.readouterr().err.splitlines()
    warnings = [line for line in err if line.startswith("align train: warning: ")]
    assert len(warnings) == 1 and len(probes) == 1, err
    need = per_gpu(r, drafter_width(r), measure(r, drafter_width(r), micro_batch_shape(r, drafter_width(r)))).total
    assert f"{need / 1e9:.1f} GB per GPU (ZeRO-0 over 8 ranks)" in warnings[0]
    assert "cuda:0 (Fake GPU) has 0.0 GB" in warnings[0]
    for change in ("train.zero_stage=1", "train.activation_checkpointing=true", "train.micro_batch_size",
                   "train.max_sequence_length"):
        assert change in warnings[0]


def test_train_without_cuda_runs_no_probe(tmp_path, monkeypatch, capsys):
    from align.memory_probe import warn_train_memory

    probes = []
    measured = _fake_cuda(monkeypatch, probes)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    warn_train_memory(recipe(f"drafter.path={_small_drafter(tmp_path)}"), measured)
    assert probes == [] and "warning" not in capsys.readouterr().err


# CUDA seen by the preflight alone (the stage then trains on the CPU, as this host can): a 1 MB device.
FAKE_GPU_PREFLIGHT = """
import sys
import torch

class FakeGpu:
    name = "Fake GPU"
    total_memory = 1_000_000

real = torch.cuda.is_available
torch.cuda.is_available = lambda: sys._getframe(1).f_code.co_name == "warn_train_memory" or real()
torch.cuda.get_device_properties = lambda device: FakeGpu()
from align.cli import main
raise SystemExit(main(["train", *sys.argv[1:]]))
"""


def test_the_train_stage_warns_once_and_still_trains(toy_trajectories, tmp_path):
    script = tmp_path / "fake_gpu_train.py"
    script.write_text(FAKE_GPU_PREFLIGHT)
    out = tmp_path / "run"
    env = checkout_env(OMP_NUM_THREADS="1")
    env.pop(MEMORY_CHECKED, None)  # a check done in the test process is not this launch's
    proc = subprocess.run([sys.executable, str(script), TINY, *overrides(toy_trajectories, out)], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("align train: warning: align memory")]
    assert len(warnings) == 1 and "cuda:0 (Fake GPU) has 0.0 GB" in warnings[0], proc.stderr[-2000:]
    assert (out / "metrics.jsonl").read_text().splitlines()  # the stage started and trained
