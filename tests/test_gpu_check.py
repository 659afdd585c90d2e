"""launch/gpu_check.sh, the script to run wherever a GPU is, runs here on the CPU through the same stages, so that it
is known to work before a GPU session spends its minutes on it."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_passes_on_this_machine(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "check"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(["bash", "launch/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "every greedy output identical to its reference" in proc.stdout
    assert "specdiff@aligned: exact_match 1.00" in proc.stdout and "spiffy_d4: exact_match 1.00" in proc.stdout
    assert (tmp_path / "check" / "run" / "step_6" / "model.safetensors").is_file()
