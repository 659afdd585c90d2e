"""launch/gpu_check.sh, the script to run wherever a GPU is, runs here on the CPU through the same stages, so that it
is known to work before a GPU session spends its minutes on it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this file out; CI runs it

ROOT = Path(__file__).resolve().parents[1]


def gpu_check(out: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "launch/gpu_check.sh"], cwd=ROOT, env={**os.environ, "OUT": str(out),
                          "HF_HUB_OFFLINE": "1", **env}, capture_output=True, text=True, timeout=900)


def test_gpu_check_passes_on_this_machine(tmp_path):
    proc = gpu_check(tmp_path / "check")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "every greedy output identical to its reference" in proc.stdout
    assert "specdiff@aligned: exact_match 1.00" in proc.stdout and "spiffy_d4: exact_match 1.00" in proc.stdout
    assert "gpu_check: spiffy_exact: ok" in proc.stdout
    assert (tmp_path / "check" / "run" / "step_6" / "model.safetensors").is_file()


def test_a_failed_stage_is_listed_and_skips_only_the_stages_that_need_it(tmp_path):
    """On a GPU one run should report every broken stage, not only the first: here an interpreter (ALIGN_PYTHON: the
    user's own environment) that fails `align bootstrap` alone."""
    python = tmp_path / "python"
    python.write_text(f'#!/usr/bin/env bash\ncase " $* " in *" bootstrap "*) exit 7;; esac\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    proc = gpu_check(tmp_path / "check", ALIGN_PYTHON=str(python))
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("gpu_check: ") and ": " in line[11:]]
    assert "gpu_check: bootstrap: FAILED (exit 7)" in lines
    assert "gpu_check: train: skipped (trajectories did not succeed)" in lines
    assert "gpu_check: spiffy_exact: skipped (spiffy_eval did not succeed)" in lines
    assert proc.stdout.rstrip().endswith(f"gpu_check: FAILED ({tmp_path / 'check'})")
