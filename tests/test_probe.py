"""The probe of bad inputs and faults (tests/probe.py), its fast subset: every CLI command and the Python API refuse
bad input in one line before any work, and nothing that existed is changed (issue 24). The whole table, with the
operator's faults (resumes, signals, full disks), runs with `python tests/probe.py`."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import checkout_env

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this file out; CI runs it

ROOT = Path(__file__).resolve().parents[1]


def test_the_fast_probe_cases_are_clean_or_handled(toy_family, tmp_path):
    # Its own process: the probe reads stderr at the file-descriptor level (where logging and warnings write too),
    # which pytest's capture would take from it.
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "probe.py"), "--ci", "--strict", "--family",
                           str(toy_family[0]), "--out", str(tmp_path / "table.md")],
                          capture_output=True, text=True, timeout=900, env=checkout_env(OMP_NUM_THREADS="1"))
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, f"{summary}\n{done.stderr[-4000:]}"
    assert int(summary.split()[0]) >= 150, summary
