"""Experiment trackers: a run's metrics sent, from rank 0, to TensorBoard, Weights & Biases or Trackio.

The names are transformers' `report_to` names, so `train.report_to` reads as a TrainingArguments one and the GKD
baseline hands the same list to TRL's trainer. A tracker is opened once, with the run folder, the run's name and the
resolved recipe as its config; `log(metrics, step)` sends a step's numbers and `close()` flushes them.

    trackers = open_trackers(["tensorboard", "wandb"], out, project="align", run_name="tiny-align", config=recipe)
    trackers.log({"loss": 2.31, "lr": 1e-4}, step=1)
    trackers.close()

Where each writes: tensorboard `<out>/tensorboard/`, wandb `<out>/wandb/` (an `offline-run-*` folder under
WANDB_MODE=offline, for `wandb sync`), trackio its local store (`$TRACKIO_DIR`, by default
`~/.cache/huggingface/trackio`, shown by `trackio show`).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Optional

from align.config import RecipeError, first_line
from align.recipe_fields import TRACKER_NAMES
from align.disk import write_text_atomic

INSTALL_TRACKERS = "pip install 'align-drafters[trackers]'"
# What the run folder remembers about its trackers between a run and its resumption (the wandb run's id).
TRACKERS_FILE = "trackers.json"


def resolve(report_to: list[str]) -> list[str]:
    """The trackers a `report_to` list names: "all" is every installed one (as in transformers), "none" none."""
    if report_to == ["all"]:
        return [name for name in TRACKER_NAMES if importlib.util.find_spec(name) is not None]
    return [name for name in report_to if name != "none"]


def check_trackers(key: str, report_to: list[str], project: str) -> None:
    """Refuse, before any work, a tracker that could not log: not installed, or wandb online without credentials.
    Only local files are read (wandb's settings, netrc, environment), never the network."""
    for name in resolve(report_to):
        if importlib.util.find_spec(name) is None:
            install = "pip install tensorboard" if name == "tensorboard" else INSTALL_TRACKERS
            raise RecipeError(f"{key}: {name} is not installed: {install}")
        if name == "wandb":
            _check_wandb_credentials(key)
        if name == "trackio":
            _check_trackio_project(key, project)


def _check_wandb_credentials(key: str) -> None:
    from wandb.sdk import wandb_setup

    try:  # settings come from WANDB_* variables and wandb's settings files (`wandb offline` writes one)
        settings = wandb_setup.singleton().settings
    except Exception as e:  # pydantic's error for e.g. WANDB_MODE=ofline
        raise RecipeError(f"{key}: wandb's settings are invalid ({first_line(e)}); check the WANDB_* "
                          "variables") from None
    if settings.mode in ("offline", "dryrun", "disabled"):
        return
    try:
        # The lookup wandb.init makes (WANDB_API_KEY, an identity token file, ~/.netrc, settings), without prompting
        # and without asking the server.
        from wandb.sdk.lib import wbauth

        found = wbauth.authenticate_session(host=settings.base_url, source="align", prompt=False,
                                            update_session=False)
    except ImportError:  # older wandb (the extra allows >= 0.19) kept the lookup in apikey
        from wandb.sdk.lib import apikey

        found = apikey.api_key(settings=settings)
    except Exception as e:  # AuthenticationError: a key of the wrong form
        raise RecipeError(f"{key}: wandb's credentials are unusable ({first_line(e)}); run `wandb login` again, "
                          "or set WANDB_MODE=offline") from None
    if not found:
        # wandb.init would otherwise stop the run at a login prompt, or fail without a terminal.
        raise RecipeError(f"{key}: wandb is not logged in (no WANDB_API_KEY, no `wandb login`); run `wandb login`, "
                          "or set WANDB_MODE=offline to log locally (`wandb sync` uploads later)")


def _check_trackio_project(key: str, project: str) -> None:
    from trackio.sqlite_storage import SQLiteStorage

    try:  # trackio keeps a database file per project and reserves some names for its own files
        SQLiteStorage.validate_project_name(project)
    except ValueError as e:
        raise RecipeError(f"{key.rsplit('.', 1)[0]}.project: {first_line(e)}") from None


class Tracker:
    """One backend: opened with the run, sent each step's metrics, closed at the end."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class TensorBoard(Tracker):
    def __init__(self, out: Path, project: str, run_name: str, config: dict[str, Any], start: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run logs again the steps after its checkpoint: purge_step hides the first attempt's events from
        # there on, so that each step shows once.
        self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=start + 1 if start else None)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class Wandb(Tracker):
    def __init__(self, out: Path, project: str, run_name: str, config: dict[str, Any], start: int) -> None:
        import wandb

        # A resumed run continues the same wandb run: its id is kept in the run folder. wandb keeps the first value
        # of a step, and the steps a resumed run logs again have the same values (resumption is exact).
        stored = _read_trackers_file(out).get("wandb_run_id") if start else None
        self.run = wandb.init(dir=str(out), project=project, name=run_name, config=config, id=stored,
                              resume="allow" if stored else None)
        if self.run.id != stored:
            _write_trackers_file(out, wandb_run_id=self.run.id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackio(Tracker):
    def __init__(self, out: Path, project: str, run_name: str, config: dict[str, Any], start: int) -> None:
        import trackio

        # trackio finds a run by its name: a resumed run continues it, a new one starts another of the same name.
        self.run = trackio.init(project=project, name=run_name, config=config, resume="allow" if start else "never")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def _backends() -> dict[str, type[Tracker]]:
    # The names are declared once, torch- and tracker-free, in config.TRACKER_NAMES (the schema checks a recipe's
    # report_to against them); each is served by the Tracker class of the same name, case aside, as losses.py pairs
    # config.LOSSES with its functions. A name without its class fails here, at import, not mid-run.
    classes = {cls.__name__.lower(): cls for cls in Tracker.__subclasses__()}
    missing = [name for name in TRACKER_NAMES if name not in classes]
    if missing:
        raise ImportError(f"align.tracking: no Tracker class for {missing} (config.TRACKER_NAMES)")
    return {name: classes[name] for name in TRACKER_NAMES}


# report_to name -> backend
TRACKERS: dict[str, type[Tracker]] = _backends()


class Trackers:
    """Every tracker of a run, logged to and closed together."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Send a step's numbers (non-numbers are left out: trackers plot scalars)."""
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for tracker in self.trackers:
            tracker.log(numbers, step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def open_trackers(report_to: list[str], out: Path, project: str, run_name: Optional[str], config: dict[str, Any],
                  start: int = 0) -> Trackers:
    """Open the trackers `report_to` names for the run in `out` (call on rank 0 only). `run_name` None: the run
    folder's name. `start`: the step a resumed run continues after (0: a new run)."""
    out.mkdir(parents=True, exist_ok=True)
    name = run_name or out.resolve().name
    return Trackers([TRACKERS[t](out, project, name, config, start) for t in resolve(report_to)])


def _read_trackers_file(out: Path) -> dict[str, Any]:
    path = out / TRACKERS_FILE
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:  # a hand-edited or cut file: start afresh rather than fail the run over a tracker's id
        return {}


def _write_trackers_file(out: Path, **values: Any) -> None:
    write_text_atomic(out / TRACKERS_FILE, json.dumps({**_read_trackers_file(out), **values}, indent=2))
