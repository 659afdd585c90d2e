"""Every recipe validates, and the real-model recipes run at tiny size: the same recipe, with its Hub models replaced
by tiny random local folders of the same architectures (a Qwen2 verifier and a Dream-style remote-code drafter for
the DiffuCoder pairing; a LLaDA-style remote-code dLLM for Spiffy), through the same stages, in seconds."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import checkout_env

from align.recipe_files import load_recipe
from remote_code_families import write_family, write_prompts, write_qwen2

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this file out; CI runs it

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.relative_to(ROOT / "recipes").as_posix())
def test_every_recipe_validates(path):
    recipe = load_recipe(path)
    assert recipe.verifier.path and recipe.drafter.path


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_gpu_recipe_that_trains_keeps_a_bounded_number_of_saves(path):
    """The real pairings' recipes (recipes/*.yaml) are for GPUs, where a save of a 26B drafter with its DeepSpeed
    state is ~416 GB: one that trains sets train.keep_last (Spiffy's LLaDA recipe trains nothing)."""
    recipe = load_recipe(path)
    trains = "train" in yaml.safe_load(path.read_text())
    assert not trains or recipe.train.keep_last is not None, f"{path.name} trains and keeps every save"


def local_prompts(prefix: str, prompts: Path) -> list[str]:
    """Point a prompt source at a local JSONL of plain `prompt` strings (the tiny tokenizer has no chat template)."""
    split, column = {"data": ("train_split", "prompt_column"), "calibrate": ("split", "prompt_column")}[prefix]
    source = "train_prompts" if prefix == "data" else "prompts"
    return [f"{prefix}.{source}={prompts}", f"{prefix}.{split}=train", f"{prefix}.{column}=prompt"]


def run_align(*args: str) -> bool:
    """`align ARGS` in a fresh process (python -m align, this checkout's); True when it exits 0, else the test fails
    with its output's end."""
    proc = subprocess.run([sys.executable, "-m", "align", *args], cwd=ROOT, capture_output=True, text=True,
                          env=checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"), timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return True


def test_the_diffucoder_recipe_runs_at_tiny_size(tmp_path):
    recipe = ROOT / "recipes" / "qwen2.5-7b-diffucoder.yaml"
    prompts = write_prompts(tmp_path / "prompts.jsonl", 24)
    # Hub ids -> tiny random folders of the same architectures; sizes cut down; everything else as the recipe says
    # (bf16 models and training, ZeRO-2, LoRA r=32: all of them run on a CPU).
    args = [f"verifier.path={write_qwen2(tmp_path / 'qwen2', seed=3)}",
            f"drafter.path={write_family('dream', tmp_path / 'dream', seed=1)}", *local_prompts("data", prompts),
            f"trajectories.out={tmp_path / 'traj'}", "trajectories.num_prompts=24", "trajectories.max_new_tokens=12",
            "trajectories.batch_size=8", f"train.out={tmp_path / 'run'}", "train.max_steps=1", "train.gamma=4",
            "train.gradient_accumulation_steps=2", "train.final_eval_prompts=1", "decode.gamma=4"]
    assert run_align("trajectories", str(recipe), *args)
    env = checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "align/train.py", str(recipe), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    step = tmp_path / "run" / "step_1"
    meta = json.loads((step / "meta.json").read_text())
    assert meta["recipe"]["train"]["zero_stage"] == 2 and meta["recipe"]["train"]["lora_r"] == 32
    assert meta["drafter_spec"]["logits_shift"] == 1 and meta["final_tau"] >= 1.0
    assert json.loads((step / "config.json").read_text())["dtype"] == "bfloat16"


def test_the_llada_spiffy_recipe_runs_at_tiny_size(tmp_path):
    recipe = ROOT / "recipes" / "llada-8b-spiffy.yaml"
    prompts = write_prompts(tmp_path / "prompts.jsonl", 6)
    args = [f"drafter.path={write_family('llada', tmp_path / 'llada', seed=7)}", *local_prompts("calibrate", prompts),
            "calibrate.num_prompts=4", "calibrate.block_length=8", "calibrate.budget=3",
            f"calibrate.out={tmp_path / 'spiffy'}", "decode.max_new_tokens=16"]
    # Each command in a fresh process, as a user runs them: the drafter's config is read before any model loads, and
    # LLaDA's code registers its class with AutoConfig when imported (a config read before align's shims failed
    # with "'LLaDAConfig' object has no attribute 'use_cache'", issue 34)
    assert run_align("calibrate", str(recipe), *args)
    graph = tmp_path / "spiffy" / "draft_graph.json"
    assert json.loads(graph.read_text())["drafter_spec"]["logits_shift"] == 0
    assert run_align("eval", str(recipe), *args, f"calibrate.graph={graph}", f"eval.prompts={prompts}",
                     "eval.num_prompts=2", "eval.spiffy_budgets=[3]", "eval.warmup=0", f"eval.out={tmp_path / 'eval'}")
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["methods"]["spiffy_d3"]["exact_match"] == 1.0
