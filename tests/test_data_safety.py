"""Nothing already written is lost (issue 24): an output folder is replaced or written into only when align wrote it;
a refused stage has written nothing; a run resumes only with the settings it was started with, and a finished one
adds nothing; a folder a run writes is locked; the README's commands share folders only where their settings agree."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TOY_TRAJECTORIES, checkout_env

from align.cli import main
from align.config import RecipeError
from align.recipe_files import get_key, load_recipe
from align.disk import HELD_LOCKS, MARKER, atomic_folder, check_output_owner, folder_kind, folder_lock, mark_folder

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "checkpoints" / "tiny"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)  # the shipped recipes name checkpoints/tiny relative to the repository


def refused(capsys, *argv: object) -> str:
    """Run `align <argv>` in-process; assert a one-line refusal with exit 2; return the line."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (hidden ones too) -> its sha256."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def users_folder(path: Path) -> Path:
    """A folder align did not write: what `export.out=$PWD` pointed at."""
    (path / "notes").mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    (path / "notes" / "plan.md").write_text("also mine")
    return path


def training_run(path: Path) -> Path:
    """A training run's folder, as the issue's export deleted one (unmarked: an older align's)."""
    (path / "ds_state" / "step_1").mkdir(parents=True)  # DeepSpeed's tag (from before states carried checksums)
    (path / "ds_state" / "latest").write_text("step_1")
    (path / "step_1").mkdir()
    (path / "step_1" / "meta.json").write_text(json.dumps({"step": 1}))
    (path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (path / "notes.txt").write_text("what I tried")
    return path


# --------------------------------------------------------------------------------------------------------------------
# 1. an output folder is replaced (or written into) only if align wrote it
# --------------------------------------------------------------------------------------------------------------------
def test_what_counts_as_an_align_folder(tmp_path):
    assert folder_kind(tmp_path / "missing") == "" and folder_kind(tmp_path) == ""
    (tmp_path / ".x.lock").write_text("")  # align's own leftovers do not make a folder the user's
    assert folder_kind(tmp_path) == ""
    marked = mark_folder(tmp_path / "eval", "eval")
    (marked / "eval.json").write_text("{}")
    assert folder_kind(marked) == "eval"
    assert folder_kind(training_run(tmp_path / "old-run")) == "train"  # unmarked, by the files it holds
    assert folder_kind(TINY / "verifier") == "bootstrap" and folder_kind(TINY) == "bootstrap"  # the shipped family
    assert folder_kind(users_folder(tmp_path / "mine")) is None


def test_owner_rules(tmp_path):
    mine, run = users_folder(tmp_path / "mine"), training_run(tmp_path / "run")
    for replaced in (False, True):
        with pytest.raises(RecipeError, match=r"^export.out: .*mine is not empty and align did not write it"):
            check_output_owner("export.out", mine, "export", replaced=replaced)
        with pytest.raises(RecipeError, match=r"^export.out: .*run is not empty and it holds align train output"):
            check_output_owner("export.out", run, "export", replaced=replaced)
        check_output_owner("train.out", run, "train", replaced=replaced)
        check_output_owner("export.out", tmp_path / "new", "export", replaced=replaced)
    # A folder holding only align outputs' folders (data/tiny holding trajectories/) may be written into, never
    # replaced: that would delete them.
    parent = tmp_path / "data"
    mark_folder(parent / "trajectories", "trajectories")
    (parent / "trajectories" / "manifest.json").write_text("{}")
    check_output_owner("data.dir", parent, "data")
    with pytest.raises(RecipeError):
        check_output_owner("export.out", parent, "export", replaced=True)


def test_a_folder_align_did_not_write_is_never_replaced(tmp_path):
    mine = users_folder(tmp_path / "out")
    before = snapshot(mine)
    with pytest.raises(RecipeError, match="align did not write it"):
        with atomic_folder(mine, "export") as tmp:
            (tmp / "model.safetensors").write_text("new")
    assert snapshot(mine) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left
    with atomic_folder(tmp_path / "export", "export") as tmp:
        (tmp / "a").write_text("1")
    with atomic_folder(tmp_path / "export", "export") as tmp:  # an earlier export is replaced
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == [MARKER, "b"]


def test_export_refuses_a_training_run_and_a_users_folder_and_replaces_an_earlier_export(capsys, tmp_path):
    base = ["export", "recipes/tiny/align.yaml", f"drafter.path={TINY / 'drafter-base'}"]
    for folder in (training_run(tmp_path / "run"), users_folder(tmp_path / "cwd")):
        before = snapshot(folder)
        line = refused(capsys, *base, f"export.out={folder}")
        assert line.startswith(f"align export: error: export.out: {folder} is not empty"), line
        assert snapshot(folder) == before
    out = tmp_path / "export"
    assert main([*base, f"export.out={out}"]) == 0
    assert json.loads((out / MARKER).read_text())["written_by"] == "export"
    (out / "stale.txt").write_text("from the earlier export")
    assert main([*base, f"export.out={out}"]) == 0  # an earlier export: replaced whole
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()


OUTPUTS = [("bootstrap", "bootstrap.yaml", "bootstrap.out"), ("bootstrap", "bootstrap.yaml", "data.dir"),
           ("trajectories", "align.yaml", "trajectories.out"), ("trajectories", "align.yaml", "data.dir"),
           ("train", "align.yaml", "train.out"), ("gkd", "align.yaml", "gkd.out"),
           ("calibrate", "spiffy.yaml", "calibrate.out"), ("eval", "eval.yaml", "eval.out"),
           ("eval", "eval.yaml", "data.dir"), ("export", "eval.yaml", "export.out"),
           ("serve-check", "dflash.yaml", "serve_check.out")]


@pytest.mark.parametrize("stage, recipe, key", OUTPUTS, ids=[f"{s}-{k}" for s, _, k in OUTPUTS])
def test_every_stage_refuses_an_output_folder_align_did_not_write(capsys, started, tmp_path, stage, recipe, key):
    folder = users_folder(tmp_path / "out")
    before = snapshot(folder)
    line = refused(capsys, stage, f"recipes/tiny/{recipe}", f"{key}={folder}")
    assert line.startswith(f"align {stage}: error: {key}: {folder} is not empty and align did not write it"), line
    assert not started and snapshot(folder) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no lock or temporary left behind


def test_an_align_output_of_another_kind_is_refused(capsys, started, tmp_path):
    traj = mark_folder(tmp_path / "traj", "trajectories")
    (traj / "manifest.json").write_text("{}")
    line = refused(capsys, "eval", "recipes/tiny/eval.yaml", f"eval.out={traj}")
    assert "holds align trajectories output" in line and not started
    line = refused(capsys, "bootstrap", "recipes/tiny/bootstrap.yaml", f"bootstrap.out={tmp_path / 'same'}",
                   f"data.dir={tmp_path / 'same'}")
    assert "data.dir: " in line and "is also bootstrap.out" in line and not started


def test_verify_costs_refuses_an_out_it_may_not_write_before_the_benchmark(capsys, tmp_path):
    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": 1}')
    for out, expected in ((tmp_path, "is a folder"), (mine, "is not a file align wrote")):
        line = refused(capsys, "verify-costs", "qwen2.5-1.5b", "--device", "cpu", "--out", out)
        assert line.startswith("align verify-costs: error: --out: ") and expected in line, line
    assert mine.read_text() == '{"mine": 1}'


# --------------------------------------------------------------------------------------------------------------------
# 2. no stage writes anything before its checks pass
# --------------------------------------------------------------------------------------------------------------------
def test_a_refused_bootstrap_leaves_data_dir_and_its_models_as_they_were(toy_family, tmp_path, capsys):
    root, _ = toy_family
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    before = snapshot(data)
    line = refused(capsys, "bootstrap", "recipes/tiny/bootstrap.yaml", f"bootstrap.out={tmp_path / 'ck'}",
                   f"data.dir={data}", "bootstrap.corpus_fraction=0.05")
    assert "bootstrap.corpus_fraction: 0.05 leaves no validation files" in line, line
    assert snapshot(data) == before and not (tmp_path / "ck").exists()
    line = refused(capsys, "bootstrap", "recipes/tiny/bootstrap.yaml", f"bootstrap.out={tmp_path / 'ck'}",
                   f"data.dir={tmp_path / 'fresh'}", "bootstrap.parts=[verifier]", "bootstrap.corpus_fraction=0.15")
    assert "bootstrap.parts: there is no tokenizer" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


# --------------------------------------------------------------------------------------------------------------------
# 3, 5. a run resumes only with its own settings; a finished run adds nothing
# --------------------------------------------------------------------------------------------------------------------
def train_args(trajectories, out, *extra):
    root, traj = trajectories
    return ["train", "recipes/tiny/align.yaml", f"drafter.path={root / 'ck' / 'drafter-base'}",
            f"verifier.path={root / 'ck' / 'verifier'}", f"trajectories.out={traj}", *TOY_TRAJECTORIES,
            f"train.out={out}", "train.gamma=4", "train.windows_per_sequence=2", "train.micro_batch_size=2",
            "train.warmup_steps=0", "train.eval_every=100", "train.max_steps=2", "train.final_eval_prompts=1", *extra]


def align_process(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "align", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          env=checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"), timeout=600)


def test_a_run_resumes_only_with_its_settings_and_a_finished_one_adds_nothing(toy_trajectories, tmp_path, capsys):
    out = tmp_path / "run"
    done = align_process(*train_args(toy_trajectories, out))
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = (out / "metrics.jsonl").read_text()
    assert sum("final_tau" in line for line in metrics.splitlines()) == 1
    assert json.loads((out / MARKER).read_text())["written_by"] == "train"
    # Rerun as it was: complete, nothing appended (finding 5).
    again = align_process(*train_args(toy_trajectories, out))
    assert again.returncode == 0 and "is complete (2 of 2 steps)" in again.stdout, again.stderr[-3000:]
    assert (out / "metrics.jsonl").read_text() == metrics
    before = snapshot(out)
    root, _ = toy_trajectories
    copy = shutil.copytree(root / "ck" / "drafter-base", tmp_path / "drafter-copy")
    # Another learning rate, drafter, loss, or a DFlash drafter: refused in one line naming the keys (finding 3),
    # before DeepSpeed (in-process here: nothing but the recipe checks runs).
    for override, named in (("train.lr=1e-2", "train.lr 0.001, now 0.01"), (f"drafter.path={copy}", "drafter.path"),
                            ("train.losses={fkl: 1.0}", "train.losses"), ("dflash.num_layers=1", "dflash None")):
        line = refused(capsys, *train_args(toy_trajectories, out, override))
        assert line.startswith(f"align train: error: train.out: {out} holds a run made with other settings") \
            and named in line, line
    line = refused(capsys, *train_args(toy_trajectories, out, "train.max_steps=1"))
    assert "train.max_steps: 1 is below step 2" in line, line
    assert snapshot(out) == before
    # What may change: the length (a longer run would continue), saving, evaluation, reporting.
    from align.stages.train import check_resume

    assert check_resume(load_recipe("recipes/tiny/align.yaml", train_args(toy_trajectories, out, "train.max_steps=5",
                                    "train.save_every=1", "train.report_to=none")[2:])) == 2


def test_a_run_resumes_only_from_the_weights_it_started_from(toy_trajectories, tmp_path, capsys):
    # run.json keeps the sha256 of the weights behind each model path (issue 35: it kept paths only, so a base drafter
    # derived again behind the same path was continued from without a word).
    from safetensors.torch import load_file, save_file

    from align.checkpoint import weights_sha256

    root, _ = toy_trajectories
    base = shutil.copytree(root / "ck" / "drafter-base", tmp_path / "base")
    out = tmp_path / "run"
    done = align_process(*train_args(toy_trajectories, out, f"drafter.path={base}", "train.max_steps=1",
                                     "train.final_eval_prompts=0"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / "run.json").read_text())["weights"] == {"drafter.path": weights_sha256(base)}
    longer = train_args(toy_trajectories, out, f"drafter.path={base}", "train.max_steps=2", "train.final_eval_prompts=0")
    from align.stages.train import check

    check(load_recipe("recipes/tiny/align.yaml", longer[2:]))  # the same weights: it resumes
    weights = load_file(base / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1e-3
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    (base / "sha256.json").unlink()  # the documented route for a deliberate edit: the check below must still see it
    before = snapshot(out)
    line = refused(capsys, *longer)
    assert line.startswith(f"align train: error: drafter.path: the weights at {base} are not the ones the run in "
                           f"{out} started from"), line
    assert snapshot(out) == before


def test_a_run_from_before_run_json_is_compared_with_its_checkpoints_recipe(toy_trajectories, tmp_path):
    from align.stages.train import check_resume

    out = tmp_path / "old"
    args = train_args(toy_trajectories, out)[2:]
    recipe = load_recipe("recipes/tiny/align.yaml", args)
    training_run(out)
    (out / "step_1" / "meta.json").write_text(json.dumps({"step": 1, "recipe": recipe.to_dict()}))
    assert check_resume(recipe) == 1
    with pytest.raises(RecipeError, match=r"train.gamma 4, now 6"):
        check_resume(load_recipe("recipes/tiny/align.yaml", [*args, "train.gamma=6"]))


# --------------------------------------------------------------------------------------------------------------------
# 4. a folder a run writes is locked
# --------------------------------------------------------------------------------------------------------------------
def test_a_folder_lock_refuses_a_second_holder_and_never_outlives_its_process(tmp_path, monkeypatch):
    folder = tmp_path / "run"
    lock = tmp_path / ".run.lock"
    lock.write_text("pid 1")  # left by a killed run: flock died with it, so it blocks nothing
    with folder_lock("train.out", folder):
        assert lock.read_text() == f"pid {os.getpid()}"
        with pytest.raises(RecipeError, match=rf"^train.out: {folder} is in use by another align run \(pid "):
            with folder_lock("train.out", folder):
                pass
        # The ranks this process launches inherit its environment and run under its lock.
        monkeypatch.setenv(HELD_LOCKS, json.dumps({str(lock): os.getpid() + 1}))
        with folder_lock("train.out", folder):
            pass
        monkeypatch.delenv(HELD_LOCKS)
        monkeypatch.setenv("RANK", "1")  # a rank other than 0 never locks: its run's rank 0 does
        with folder_lock("train.out", folder):
            pass
        monkeypatch.delenv("RANK")
    assert not lock.exists()
    with folder_lock("train.out", folder):  # released
        pass


HOLD = """
import sys
from align.disk import folder_lock
with folder_lock("out", sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def held(tmp_path):
    """Lock a folder from another process (another run), for the test's duration."""
    holders = []

    def hold(folder: Path) -> int:
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=ROOT, env=checkout_env(),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "held"
        holders.append(proc)
        return proc.pid

    yield hold
    for proc in holders:
        proc.stdin.close()
        proc.wait(timeout=60)


LOCKED = [("train", "align.yaml", "train.out"), ("trajectories", "align.yaml", "trajectories.out"),
          ("eval", "eval.yaml", "eval.out"), ("export", "eval.yaml", "export.out"),
          ("bootstrap", "bootstrap.yaml", "data.dir")]


@pytest.mark.parametrize("stage, recipe, key", LOCKED, ids=[s for s, _, _ in LOCKED])
def test_a_second_run_into_a_folder_in_use_is_refused(capsys, started, held, toy_trajectories, tmp_path, stage,
                                                     recipe, key):
    root, traj = toy_trajectories
    folder = tmp_path / "out"
    pid = held(folder)
    models = [f"verifier.path={root / 'ck' / 'verifier'}", f"drafter.path={root / 'ck' / 'drafter-base'}",
              f"trajectories.out={traj}", *TOY_TRAJECTORIES] if stage == "train" else []
    line = refused(capsys, stage, f"recipes/tiny/{recipe}", *models, f"{key}={folder}")
    assert line == f"align {stage}: error: {key}: {folder} is in use by another align run (pid {pid}); wait for " \
                   "it to end, or choose another folder"
    assert not started and not folder.exists()


# --------------------------------------------------------------------------------------------------------------------
# 6. the README's commands, in any order: folders they share are made with the same settings
# --------------------------------------------------------------------------------------------------------------------
COMMAND = re.compile(r"(?:^|[\s;(])(?:\S*/)?align (trajectories|train) (.*)$")
SCRIPT = re.compile(r"(?:^|\s)bash ((?:launch|experiments)/\w+\.sh)((?: [^\s`|;&]+)*)")
ASSIGNMENT = re.compile(r"^(\w+)=(\(.*\)|[^\s$()`]+)$")


def logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations and multi-line array assignments joined, comments dropped."""
    lines, pending = [], ""
    for raw in text.splitlines():
        line = pending + (" " if pending else "") + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1].strip()
        elif re.match(r"^\w+=\(", line) and ")" not in line:
            pending = line
        else:
            pending = ""
            lines.append(line)
    return [line for line in lines if line and not line.startswith("#")]


def commands_of(lines: list[str], arguments: list[str], origin: str):
    """(origin, stage, recipe, overrides) of each `align trajectories|train` the lines run, variables with literal
    values substituted; a command still naming a variable (a loop's, a command's output) is left out."""
    variables: dict[str, list[str]] = {}
    for line in lines:
        found = ASSIGNMENT.match(line)
        if found:
            value = found.group(2)
            variables[found.group(1)] = shlex.split(value[1:-1]) if value.startswith("(") else [value]
            continue
        expanded = line.replace('"$@"', " ".join(map(shlex.quote, arguments)))
        for name, value in variables.items():
            quoted = " ".join(map(shlex.quote, value))
            expanded = expanded.replace(f'"${{{name}[@]}}"', quoted).replace(f'"${name}"', quoted)
            expanded = re.sub(rf"\${name}\b|\${{{name}}}", lambda _: shlex.quote(value[0]), expanded)
        script = SCRIPT.search(expanded)
        if script:
            path = ROOT / script.group(1)
            yield from commands_of(logical_lines(path.read_text()), shlex.split(script.group(2)), f"{origin} -> "
                                   f"{script.group(1)}")
            continue
        found = COMMAND.search(expanded)
        if not found:
            continue
        try:
            tokens = shlex.split(found.group(2), comments=True)
        except ValueError:
            continue
        cut = next((i for i, t in enumerate(tokens) if t in ("|", "||", "&&", ";") or t.startswith(("2>", ">"))),
                   len(tokens))
        tokens = tokens[:cut]
        if not tokens or any("$" in t for t in tokens):
            continue
        overrides = [t for t in tokens[1:] if "=" in t and not t.startswith("-")]
        yield origin, found.group(1), tokens[0], overrides


def readme_commands():
    """The commands of the README and of every docs page (their bash blocks and inline spans)."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text, origin = page.read_text(), str(page.relative_to(ROOT))
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
            yield from commands_of(logical_lines(block), [], origin)
        for span in re.findall(r"`([^`\n]*(?:\n[^`\n]*)?)`", re.sub(r"```.*?```", "", text, flags=re.S)):
            yield from commands_of([" ".join(span.split())], [], origin)


def all_commands():
    """Every README command (and the scripts it runs), every launch and experiment script, and each recipe run as it
    is."""
    yield from readme_commands()
    for script in sorted([*(ROOT / "launch").glob("*.sh"), *(ROOT / "experiments").glob("*.sh")]):
        yield from commands_of(logical_lines(script.read_text()), [], str(script.relative_to(ROOT)))
    import yaml

    for recipe in sorted((ROOT / "recipes").rglob("*.yaml")):
        sections = yaml.safe_load(recipe.read_text()) or {}
        for stage, section in (("trajectories", "trajectories"), ("train", "train")):
            if section in sections:
                yield str(recipe.relative_to(ROOT)), stage, str(recipe.relative_to(ROOT)), []


def test_commands_that_share_a_folder_make_it_with_the_same_settings():
    from align.stages.train import run_settings
    from align.stages.trajectories import PROMPT_KEYS, SETTING_KEYS

    found = list(all_commands())
    # The parser does see the commands that once collided.
    assert any(o.endswith("tiny_dflash.sh") and s == "trajectories" for o, s, _, _ in found)
    assert any("trajectories.out=data/tiny/trajectories-800" in " ".join(v) for o, _, _, v in found
               if " -> " in o and o.split(" -> ")[0].endswith(".md"))
    made: dict[tuple[str, str], dict[str, tuple[str, dict]]] = {}
    for origin, stage, recipe_path, overrides in found:
        recipe = load_recipe(recipe_path, overrides)
        command = f"{origin}: align {stage} {recipe_path} {' '.join(overrides)}".strip()
        folders = [("trajectories.out", {k: get_key(recipe, k) for k in (*SETTING_KEYS, *PROMPT_KEYS)})]
        if stage == "train":
            folders.append(("train.out", run_settings(recipe.to_dict())))
        for key, settings in folders:
            made.setdefault((key, os.path.normpath(str(get_key(recipe, key)))), {})[command] = settings
    clashes = []
    for (key, folder), by_command in made.items():
        (first, settings), *others = by_command.items()
        for command, other in others:
            differ = sorted(k for k in settings if settings[k] != other.get(k))
            if differ:
                clashes.append(f"{key} {folder}: {first!r} and {command!r} differ in {differ}")
    assert not clashes, "\n".join(clashes)
