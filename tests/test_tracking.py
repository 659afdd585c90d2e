"""Experiment trackers (train.report_to, gkd.report_to): what each writes from a real tiny training run, read back
with the tracker's own reader; a resumed run continues its wandb run; bad tracker settings are refused before the
stage starts. Offline throughout: WANDB_MODE=offline, trackio in a temporary TRACKIO_DIR."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TOY_TRAJECTORIES
import test_bad_input
from test_bad_input import refused
from test_train import ROOT, env, launch, losses, overrides

from align.config import RecipeError
from align.recipe_fields import TRACKER_NAMES
from align.recipe_files import load_recipe
from align.tracking import TRACKERS, TRACKERS_FILE, check_trackers, open_trackers, resolve

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this file out; CI runs it

# The bad-input tests' working directory (the repository); `started` (the stages' mains replaced by a recorder) is
# conftest's.
_in_repo = test_bad_input._in_repo


@pytest.fixture(scope="module")
def trajectories(toy_trajectories):
    return toy_trajectories


@pytest.fixture
def offline(tmp_path, monkeypatch) -> Path:
    """WANDB_MODE=offline, wandb's and trackio's settings and stores under tmp_path; the trackio folder."""
    trackio_dir = tmp_path / "trackio"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return trackio_dir


# --------------------------------------------------------------------------------------------------------------------
# readers: each tracker's files, read back as the tracker wrote them
# --------------------------------------------------------------------------------------------------------------------
def tensorboard_scalars(folder: Path, tag: str) -> dict[int, float]:
    """Step -> value of a scalar, as TensorBoard shows it: each step once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()  # also drops the events a resumed run purged (SummaryWriter's purge_step)
    scalars = events.Scalars(tag) if tag in events.Tags()["scalars"] else []
    steps = [e.step for e in scalars]
    assert len(steps) == len(set(steps)), f"{tag}: steps shown more than once: {steps}"
    return {e.step: e.value for e in scalars}


def wandb_records(path: Path):
    """The records of a wandb transaction log (run-<id>.wandb): the LevelDB log format (32 KiB blocks of chunks, each
    with a 7-byte header: CRC, length, type), after wandb's 7-byte file header; each record a wandb protobuf Record.
    wandb >= 0.30 reads these files in its Go core only, so the format is read here."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, chunks = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B", path
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def wandb_run(folder: Path) -> tuple[str, str, dict[int, float], dict]:
    """(run id, run name, loss by step, config) of an offline wandb run folder."""
    (log,) = folder.glob("run-*.wandb")
    run_id, name, loss, config = "", "", {}, {}
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id, name = record.run.run_id, record.run.display_name
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "history":
            # wandb names a metric by `key` or by the path `nested_key` (as it does here since 0.30)
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            if "loss" in items:
                loss[items["_step"]] = items["loss"]
    return run_id, name, loss, config


def trackio_logs(trackio_dir: Path, project: str) -> dict[str, list[dict]]:
    """Run name -> its logged rows, read with trackio's storage in a fresh process (it reads TRACKIO_DIR on import)."""
    code = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage as S; "
            "print(json.dumps({r: S.get_logs(sys.argv[1], r) for r in S.get_runs(sys.argv[1])}))")
    out = subprocess.run([sys.executable, "-c", code, project], env={**os.environ, "TRACKIO_DIR": str(trackio_dir)},
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------------------------------
# the names
# --------------------------------------------------------------------------------------------------------------------
def test_the_schema_and_the_backends_name_the_same_trackers():
    assert tuple(TRACKERS) == TRACKER_NAMES


@pytest.mark.parametrize("value, names", [
    ("wandb", ["wandb"]), ("[wandb, trackio, wandb]", ["wandb", "trackio"]), ("none", []), ("null", []), ("[]", []),
    ("all", list(TRACKER_NAMES)), ("[all]", list(TRACKER_NAMES)), ("[none]", []),
])
def test_report_to_reads_as_transformers_report_to(value, names):
    # As TrainingArguments.report_to: a name or a list; "all" every installed tracker (all three are, in the dev
    # environment), "none" none.
    recipe = load_recipe(ROOT / "recipes/tiny/align.yaml", [f"train.report_to={value}", f"gkd.report_to={value}"])
    assert resolve(recipe.train.report_to) == resolve(recipe.gkd.report_to) == names


def test_report_to_defaults_to_tensorboard():
    recipe = load_recipe(ROOT / "recipes/tiny/align.yaml", [])
    assert recipe.train.report_to == recipe.gkd.report_to == ["tensorboard"]


def test_all_leaves_out_a_tracker_that_is_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # Python's own way of making a package unimportable
    assert resolve(["all"]) == ["tensorboard", "trackio"]


def test_none_opens_no_tracker(tmp_path, offline):
    trackers = open_trackers(["none"], tmp_path / "run", "align", None, {})
    trackers.log({"loss": 1.0}, 1)
    trackers.close()
    assert list((tmp_path / "run").iterdir()) == [] and not offline.exists()


# --------------------------------------------------------------------------------------------------------------------
# a real training run
# --------------------------------------------------------------------------------------------------------------------
def test_training_reports_to_tensorboard_wandb_and_trackio_and_a_resume_continues_them(trajectories, tmp_path,
                                                                                     offline):
    out = tmp_path / "run"
    args = overrides(trajectories, out, "train.max_steps=3", "train.save_every=2", "train.micro_batch_size=2",
                     "train.report_to=[tensorboard, wandb, trackio]", "train.project=align-test")
    rc, log = launch(1, args)
    assert rc == 0, log[-3000:]
    loss = dict(enumerate(losses(out), start=1))
    assert len(loss) == 3

    assert tensorboard_scalars(out / "tensorboard", "loss") == pytest.approx(loss, rel=1e-6)

    (first,) = (out / "wandb").glob("offline-run-*")
    run_id, name, wandb_loss, config = wandb_run(first)
    assert name == "run" and wandb_loss == pytest.approx(loss, rel=1e-6)
    assert config["train"]["report_to"] == ["tensorboard", "wandb", "trackio"]  # the resolved recipe
    assert json.loads((out / TRACKERS_FILE).read_text())["wandb_run_id"] == run_id

    runs = trackio_logs(offline, "align-test")
    assert list(runs) == ["run"]
    assert {row["step"]: row["loss"] for row in runs["run"]} == pytest.approx(loss, rel=1e-6)

    # As if the run had died after logging step 3 but before its checkpoint: the rerun resumes from step 2.
    (out / "ds_state" / "latest").write_text("step_2")
    rc, log = launch(1, args)
    assert rc == 0 and "resuming from step 2" in log, log[-3000:]
    second = [f for f in (out / "wandb").glob("offline-run-*") if f != first]
    assert len(second) == 1 and wandb_run(second[0])[0] == run_id  # the same wandb run, continued
    assert wandb_run(second[0])[2] == pytest.approx({3: loss[3]}, rel=1e-6)
    assert tensorboard_scalars(out / "tensorboard", "loss") == pytest.approx(loss, rel=1e-6)  # step 3 once
    assert list(trackio_logs(offline, "align-test")) == ["run"]  # the same trackio run


def test_report_to_none_writes_no_tracker_files(trajectories, tmp_path, offline):
    out = tmp_path / "quiet"
    rc, log = launch(1, overrides(trajectories, out, "train.max_steps=1", "train.micro_batch_size=2",
                                  "train.report_to=none"))
    assert rc == 0, log[-3000:]
    assert losses(out) and not (out / "tensorboard").exists() and not (out / "wandb").exists()
    assert not (out / TRACKERS_FILE).exists() and not offline.exists()


def test_gkd_baseline_reports_to_tensorboard_and_wandb_in_its_run_folder(trajectories, tmp_path, offline):
    root, traj = trajectories
    out = tmp_path / "gkd"
    proc = subprocess.run(
        [sys.executable, "-m", "align", "gkd", "recipes/tiny/align.yaml", f"verifier.path={root / 'ck' / 'verifier'}",
         f"ar_drafter.path={root / 'ck' / 'ar-drafter'}", f"trajectories.out={traj}", *TOY_TRAJECTORIES,
         f"gkd.out={out}", "gkd.max_steps=2", "gkd.batch_size=2", "gkd.max_new_tokens=4",
         "gkd.report_to=[tensorboard, wandb]", "gkd.run_name=distilspec"],
        cwd=ROOT, env={**env(), **{k: os.environ[k] for k in ("WANDB_MODE", "WANDB_CONFIG_DIR", "TRACKIO_DIR")}},
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    trained = json.loads((out / "final" / "meta.json").read_text())["log"]
    expected = {entry["step"]: entry["loss"] for entry in trained if "loss" in entry}
    (events,) = {f.parent for f in (out / "runs").rglob("events.out.tfevents.*")}
    assert tensorboard_scalars(events, "train/loss") == pytest.approx(expected, rel=1e-5)
    (run,) = (out / "wandb").glob("offline-run-*")
    _, name, _, config = wandb_run(run)
    assert name == "distilspec" and config["gkd"]["report_to"] == ["tensorboard", "wandb"]
    assert not (ROOT / "wandb").exists()  # not in the working directory, where TRL's callback alone would write


# --------------------------------------------------------------------------------------------------------------------
# bad input: refused before the stage starts (one line, exit 2)
# --------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def no_wandb_login(tmp_path, monkeypatch):
    """wandb online with no credentials anywhere: no key in the environment, no netrc, no settings file."""
    import wandb

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    wandb.teardown()  # wandb keeps the settings it read once per process
    yield
    wandb.teardown()


@pytest.mark.parametrize("stage", ["train", "gkd"])
def test_an_unknown_tracker_is_refused(capsys, started, stage):
    line = refused(capsys, started, stage, "recipes/tiny/align.yaml", f"{stage}.report_to=[tensorboard, mlflow]")
    assert f"{stage}.report_to" in line and "'tensorboard', 'wandb', 'trackio', 'all' or 'none'" in line


@pytest.mark.parametrize("stage", ["train", "gkd"])
def test_wandb_online_without_credentials_is_refused(capsys, started, no_wandb_login, stage):
    line = refused(capsys, started, stage, "recipes/tiny/align.yaml", f"{stage}.report_to=wandb")
    assert f"{stage}.report_to: wandb is not logged in" in line and "WANDB_MODE=offline" in line
    assert "wandb login" in line


def test_wandb_online_with_an_api_key_or_offline_passes_the_check(no_wandb_login, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)  # a key of the right form; it is never sent anywhere here
    check_trackers("train.report_to", ["wandb"], "align")
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb.teardown()
    check_trackers("train.report_to", ["wandb"], "align")


def test_a_malformed_wandb_key_is_refused(no_wandb_login, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "abc")
    with pytest.raises(RecipeError, match=r"^train.report_to: wandb's credentials are unusable .*WANDB_API_KEY"):
        check_trackers("train.report_to", ["wandb"], "align")


def test_a_misspelt_wandb_mode_is_refused(no_wandb_login, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "ofline")
    with pytest.raises(RecipeError, match=r"^train.report_to: wandb's settings are invalid"):
        check_trackers("train.report_to", ["wandb"], "align")


@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_a_tracker_that_is_not_installed_is_refused(capsys, started, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)
    line = refused(capsys, started, "train", "recipes/tiny/align.yaml", f"train.report_to={name}")
    assert line.endswith(f"train.report_to: {name} is not installed: pip install 'align-drafters[trackers]'")


def test_a_project_wandb_would_refuse_is_refused(capsys, started):
    line = refused(capsys, started, "train", "recipes/tiny/align.yaml", "train.project=team/align")
    assert "train.project: a project name has 1 to 128 characters, none of / \\ # ? % :" in line


def test_a_project_name_trackio_reserves_is_refused(capsys, started, offline):
    line = refused(capsys, started, "train", "recipes/tiny/align.yaml", "train.report_to=trackio",
                   "train.project=registry-runs")
    assert line.startswith("align train: error: train.project: ") and "reserved" in line
