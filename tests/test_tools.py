"""The small commands launch scripts use instead of parsing YAML or embedding Python: `align validate --get`,
`align latest`, `align throughput`, `align build-ops`, and the before/after table of `align eval`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import checkout_env

from align.cli import main as align
from align.stages.evaluate.speculative import before_after_table

ROOT = Path(__file__).resolve().parents[1]


def test_validate_get_prints_the_resolved_value(capsys):
    assert align(["validate", "recipes/tiny/align.yaml", "train.out=elsewhere", "--get", "train.out"]) == 0
    assert capsys.readouterr().out == "elsewhere\n"
    assert align(["validate", "recipes/tiny/align.yaml", "--get", "train.losses"]) == 0
    assert capsys.readouterr().out == "{dpace: 1.0}\n"
    assert align(["validate", "recipes/tiny/align.yaml", "--get", "train.nope"]) == 2
    assert capsys.readouterr().err == "align validate: error: unknown key 'train.nope'\n"


def test_latest_sorts_steps_as_numbers(tmp_path, capsys):
    for step in (2, 10, 9):
        (tmp_path / f"step_{step}").mkdir()
    (tmp_path / ".step_11.tmp").mkdir()  # unfinished: never the latest
    assert align(["latest", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'step_10'}\n"
    assert align(["latest", str(tmp_path / "step_2")]) == 2
    assert capsys.readouterr().err.startswith("align latest: error: no step_<N> checkpoint under")


def test_throughput_table_reads_runs(tmp_path, capsys):
    run = tmp_path / "p2-t1"
    (run / "step_4").mkdir(parents=True)
    (run / "step_4" / "meta.json").write_text(json.dumps({"world_size": 2, "threads_per_rank": 1}))
    speeds = [1.0, 1.0, 100.0, 300.0, 200.0]
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "tokens_per_s_per_rank": s}) + "\n"
                                               for i, s in enumerate(speeds)))
    assert align(["throughput", str(run), "--warmup-steps", "2"]) == 0
    assert "| p2-t1 | 2 | 1 | 200 | 400 |" in capsys.readouterr().out
    assert align(["throughput", str(tmp_path / "missing")]) == 2
    # A run with only warm-up steps (and a line cut mid-write) says so, instead of a NaN.
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "tok')
    assert align(["throughput", str(run), "--warmup-steps", "5"]) == 0
    captured = capsys.readouterr()
    assert "| p2-t1 | 2 | 1 | — (5 steps logged, none past the 5 warm-up steps) | — |" in captured.out
    assert "nan" not in captured.out and "line 6 was cut short" in captured.err


def test_before_after_table_pairs_each_method_with_its_compared_drafters():
    methods = {"ar": {"tau": 1.0, "speedup": 1.0}, "specdiff": {"tau": 1.5, "speedup": 0.6},
               "specdiff@aligned": {"tau": 3.0, "speedup": 1.2}}
    table = before_after_table(methods)
    assert "| specdiff | drafter.path | 1.50 | 1.00× | 0.60× |" in table
    assert "| specdiff | aligned | 3.00 | 2.00× | 1.20× |" in table
    assert "| ar |" not in table
    assert before_after_table({"ar": {"tau": 1.0, "speedup": 1.0}}) is None


def test_exact_fails_when_a_greedy_output_differs(tmp_path, capsys):
    same, differs = tmp_path / "same.json", tmp_path / "differs.json"
    same.write_text(json.dumps({"methods": {"ar": {"exact_match": 1.0}, "specdiff": {"exact_match": 1.0}}}))
    differs.write_text(json.dumps({"methods": {"ar": {"exact_match": 1.0}, "specdiff": {"exact_match": 0.75}}}))
    assert align(["exact", str(same)]) == 0
    assert "every greedy output identical to its reference" in capsys.readouterr().out
    assert align(["exact", str(same), str(differs)]) == 1
    assert "1 methods differ" in capsys.readouterr().out
    assert align(["exact", str(tmp_path / "missing.json")]) == 2


@pytest.mark.slow  # compiles DeepSpeed's op (about a minute)
def test_build_ops_builds_deepspeeds_cpu_op_where_later_runs_find_it(tmp_path):
    """`align build-ops` (launch/setup.sh runs it) compiles deepspeed_shm_comm into torch's extension folder and
    leaves no build lock there: a process group started after it loads the op built, and nothing waits."""
    build_root = tmp_path / "extensions"
    env = checkout_env(TORCH_EXTENSIONS_DIR=str(build_root), HF_HUB_OFFLINE="1")
    built = subprocess.run([sys.executable, "-m", "align", "build-ops"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    # (DeepSpeed's own notes, on stdout, come first)
    library = Path(built.stdout.strip().splitlines()[-1].removeprefix("align build-ops: "))
    assert library.is_file() and build_root in library.parents, built.stdout
    assert not list(build_root.glob("*/lock"))
    loaded = subprocess.run([sys.executable, "-c", "from align.dist import build_deepspeed_ops; "
                             "print(build_deepspeed_ops())"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert loaded.returncode == 0 and loaded.stdout.strip().splitlines()[-1] == str(library), loaded.stderr[-3000:]
