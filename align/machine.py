"""Where a run was measured: the machine (platform, CPU model, GPU, threads) and the software versions, as reports
(eval.json, verify-costs, serve-check) record them."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any, Optional

import torch

from align.provenance import installed_versions


# What a report names the software it was measured with: distribution names (align's is `align-drafters`).
VERSIONED = ("torch", "transformers", "align-drafters", "deepspeed", "datasets")


def versions() -> dict[str, Optional[str]]:
    """distribution -> installed version (None: not installed), VERSIONED and Python's."""
    return {"python": platform.python_version(), **installed_versions(*VERSIONED)}


def cpu_model() -> str:
    """The CPU's marketing name ("AMD EPYC 7763 64-Core Processor"): /proc/cpuinfo's `model name` on Linux; else what
    the platform says (macOS: sysctl's brand string), else the architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        import subprocess

        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            pass
    return platform.processor() or platform.machine()


def machine(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Where a run was measured. `processor` (platform.processor(), often just the architecture) stays for the readers
    of eval.json schema 1; cpu_model names the CPU, gpu the accelerator the models ran on (None on a CPU)."""
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_model": cpu_model(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "device": str(device), "dtype": str(dtype)}
