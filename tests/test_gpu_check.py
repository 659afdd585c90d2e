"""launch/gpu_check.sh, the script to run wherever a GPU is, runs here on the CPU through the same stages, so that it
is known to work before a GPU session spends its minutes on it: the tiny family's stages, bf16 decoding, the real
remote code at tiny size, a ZeRO-3 DiffusionGemma step on 2-token completions (2 ranks, gloo) and `align memory` at
7B width (on a shorter prompt here: ALIGN_GPU_CHECK_MEMORY)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this file out; CI runs it

ROOT = Path(__file__).resolve().parents[1]
# The 7B-width memory probe on a short micro-batch: its full one takes minutes on this CPU (the GPU runs the recipe's).
SHORT_MEMORY = "memory.prompt_tokens=64 trajectories.max_new_tokens=64 train.micro_batch_size=1"
TINY_STAGES = "bootstrap trajectories train eval calibrate spiffy_eval exact spiffy_exact eval_bf16 bf16_identical"


def gpu_check(out: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "launch/gpu_check.sh"], cwd=ROOT, env={**os.environ, "OUT": str(out),
                          "HF_HUB_OFFLINE": "1", "ALIGN_GPU_CHECK_MEMORY": SHORT_MEMORY, **env},
                          capture_output=True, text=True, timeout=1800)


def test_gpu_check_passes_on_this_machine(tmp_path):
    proc = gpu_check(tmp_path / "check")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "every greedy output identical to its reference" in proc.stdout
    assert "specdiff@aligned: exact_match 1.00" in proc.stdout and "spiffy_d4: exact_match 1.00" in proc.stdout
    assert "gpu_check: spiffy_exact: ok" in proc.stdout
    assert (tmp_path / "check" / "run" / "step_6" / "model.safetensors").is_file()
    # the real-code parts, each with its PASS line
    for part in ("remote_code", "zero3_diffusion_gemma", "memory", "eval_bf16", "bf16_identical"):
        assert f"gpu_check: PASS {part}" in proc.stdout
    assert "gpu_check: PASS remote_code dream:" in proc.stdout and "gpu_check: PASS remote_code llada:" in proc.stdout
    assert "gpu_check: zero3: 2 rank(s) (0 GPU(s))" in proc.stdout
    assert "gpu_check: bf16 identical to AR greedy: " in proc.stdout
    assert "per GPU peak" in proc.stdout and "hidden 3584" in proc.stdout  # Qwen2.5-7B's width


def test_a_failed_stage_is_listed_and_skips_only_the_stages_that_need_it(tmp_path):
    """On a GPU one run should report every broken stage, not only the first: here an interpreter (ALIGN_PYTHON: the
    user's own environment) that fails `align bootstrap` alone."""
    python = tmp_path / "python"
    python.write_text(f'#!/usr/bin/env bash\ncase " $* " in *" bootstrap "*) exit 7;; esac\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    proc = gpu_check(tmp_path / "check", ALIGN_PYTHON=str(python), ALIGN_GPU_CHECK_STAGES=TINY_STAGES)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("gpu_check: ") and ": " in line[11:]]
    assert "gpu_check: bootstrap: FAILED (exit 7)" in lines
    assert "gpu_check: train: skipped (trajectories did not succeed)" in lines
    assert "gpu_check: spiffy_exact: skipped (spiffy_eval did not succeed)" in lines
    assert "gpu_check: bf16_identical: skipped (eval_bf16 did not succeed)" in lines
    assert "gpu_check: FAIL bootstrap (exit 7)" in proc.stdout.splitlines()
    assert proc.stdout.rstrip().endswith(f"gpu_check: FAILED ({tmp_path / 'check'})")


def test_remote_code_that_does_not_load_is_a_fail_line_and_a_non_zero_exit(tmp_path):
    """$ALIGN_REMOTE_CODE names where the real modelling files are; a folder without them fails both families."""
    proc = gpu_check(tmp_path / "check", ALIGN_PYTHON=sys.executable, ALIGN_GPU_CHECK_STAGES="remote_code",
                     ALIGN_REMOTE_CODE=str(tmp_path / "nothing-here"))
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    assert "gpu_check: FAIL remote_code dream:" in proc.stdout and "gpu_check: FAIL remote_code llada:" in proc.stdout
    assert "gpu_check: remote_code: FAILED (exit 1)" in proc.stdout


def test_remote_code_loads_the_fixtures_through_the_shims(tmp_path):
    proc = gpu_check(tmp_path / "check", ALIGN_PYTHON=sys.executable, ALIGN_GPU_CHECK_STAGES="remote_code")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "shims ['generation_config_validate', 'rope_default']" in proc.stdout  # dream's
    assert "shims ['config_use_cache', 'post_init', 'tie_weights'], masks ignored True" in proc.stdout  # llada's


def test_memory_on_cuda_without_a_gpu_is_refused_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "align", "memory", "recipes/qwen2.5-7b-diffucoder.yaml",
                           "memory.device=cuda"], cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        pytest.skip("a GPU is visible here")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "memory.device" in proc.stderr and "cuda" in proc.stderr
