"""Faults, and what align guarantees through them: an interrupt stops every process align started, with one line;
checkpoints are checked against their checksums wherever they are read, and non-finite weights are never exported;
an appended log survives a cut last line, a damaged DeepSpeed state is named; a full disk is one line naming the path.
"""

import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TOY_TRAJECTORIES, checkout_env

from align.checkpoint import commit_state, state_to_resume
from align.cli import main as align
from align.config import RecipeError
from align.disk import CHECKSUMS, append_log, disk_fault, naming_path, read_log, record_checksums, verify_checksums

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this file out; CI runs it

ROOT = Path(__file__).resolve().parents[1]


def overrides(trajectories, out, *extra):
    root, traj = trajectories
    return [f"drafter.path={root / 'ck' / 'drafter-base'}", f"verifier.path={root / 'ck' / 'verifier'}",
            f"trajectories.out={traj}", *TOY_TRAJECTORIES, f"train.out={out}", "train.gamma=4",
            "train.windows_per_sequence=2", "train.micro_batch_size=2", "train.lr=3e-3", "train.warmup_steps=0",
            "train.eval_every=100", "train.final_eval_prompts=0", *extra]


PROGRESS_BAR = re.compile(r"\d+/\d+ \[")  # tqdm's "n/total [elapsed<remaining"


def lines_said(stderr: str) -> list[str]:
    """What a command said on stderr, its progress bars (\r-updated, or a line each when not a terminal) left out."""
    return [line for line in re.split(r"[\r\n]", stderr) if line.strip() and not PROGRESS_BAR.search(line)]


# --------------------------------------------------------------------------------------------------------------------
# interrupts
# --------------------------------------------------------------------------------------------------------------------
def process_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, start time) of every process, from /proc."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            table[int(entry.name)] = (int(fields[1]), fields[0], fields[19])
    return table


def descendants(pid: int) -> dict[int, str]:
    """pid -> start time of every process below `pid`."""
    table, found, frontier = process_table(), {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, _, start) in table.items():
            if ppid == parent and child not in found:
                found[child] = start
                frontier.append(child)
    return found


def survivors(processes: dict[int, str]) -> list[int]:
    """Those of `processes` still running (the same process: a pid may be reused; a zombie has ended)."""
    table = process_table()
    return [pid for pid, start in processes.items() if pid in table and table[pid][2] == start
            and table[pid][1] != "Z"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_align(args: list[str], stderr: Path) -> subprocess.Popen:
    # Its own session, as a shell gives a command: a terminal's Ctrl-C is SIGINT to that group.
    return subprocess.Popen([sys.executable, "-m", "align.cli", *args], cwd=ROOT, start_new_session=True,
                            env=checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1"),
                            stdout=subprocess.DEVNULL, stderr=stderr.open("w"))


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
@pytest.mark.parametrize("signum, how", [(signal.SIGINT, "terminal"), (signal.SIGTERM, "kill")])
def test_an_interrupt_stops_the_launcher_and_every_rank_with_one_line(toy_trajectories, tmp_path, signum, how):
    out, log = tmp_path / "run", tmp_path / "stderr"
    # A checkpoint every 2 steps moves `latest`; the interrupt comes as soon as the first is on disk, with 22 steps
    # to go, which the resumed run then makes.
    recipe = ["recipes/tiny/align.yaml", *overrides(toy_trajectories, out, "train.max_steps=24", "train.save_every=2")]
    args = ["train", *recipe, "--num_gpus", "2", "--master_port", str(free_port())]
    proc = start_align(args, log)
    latest = out / "ds_state" / "latest"
    deadline = time.time() + 400
    while proc.poll() is None and time.time() < deadline and not (latest.is_file() and latest.read_text()):
        time.sleep(0.1)
    assert proc.poll() is None, log.read_text()[-3000:]
    started = descendants(proc.pid)
    ranks = [pid for pid in started if "align/train.py" in Path(f"/proc/{pid}/cmdline").read_text()]
    assert len(ranks) >= 2, started  # the launcher's two ranks (each may have helpers of its own)
    said_before = log.stat().st_size
    if how == "terminal":
        os.killpg(proc.pid, signum)  # Ctrl-C in a terminal: SIGINT to the foreground process group
    else:
        os.kill(proc.pid, signum)  # `timeout`, a scheduler, kill: the align process alone
    rc = proc.wait(timeout=120)
    assert rc == 128 + signum
    assert survivors(started) == []  # align returned only once every process it started had ended
    after = latest.read_text(), (out / "metrics.jsonl").read_text()
    text = log.read_text()
    said = text[text.rfind("\n", 0, said_before) + 1:].splitlines()  # from the start of the line then written
    # One line, last, and nothing else but the progress bars of the steps made before the ranks were stopped: no
    # traceback or KeyboardInterrupt from any rank, the launcher or the deepspeed runner.
    how = "" if signum == signal.SIGINT else " by SIGTERM"
    assert said[-1] == f"align train: interrupted{how}; every process it started is stopped"
    assert lines_said("\n".join(said[:-1])) == [], said
    assert (latest.read_text(), (out / "metrics.jsonl").read_text()) == after  # nobody writes any more
    if signum == signal.SIGTERM:  # and the run resumes (one process is enough: ZeRO-0 states load in any layout)
        rc = subprocess.run([sys.executable, "-m", "align.cli", "train", *recipe], cwd=ROOT, capture_output=True,
                            env=checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"), text=True, timeout=600)
        assert rc.returncode == 0 and f"resuming from step {after[0].removeprefix('step_')}" in rc.stdout, \
            rc.stdout[-2000:] + rc.stderr[-2000:]
        assert [r["step"] for r in read_log(out / "metrics.jsonl")] == list(range(1, 25))


# --------------------------------------------------------------------------------------------------------------------
# checksums
# --------------------------------------------------------------------------------------------------------------------
def flip_a_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def ck(toy_family) -> Path:
    return toy_family[0] / "ck"


def test_a_step_folder_carries_checksums_and_a_flipped_bit_is_named_by_every_reader(toy_family, tmp_path, capsys):
    drafter = tmp_path / "step_7"
    shutil.copytree(ck(toy_family) / "drafter-base", drafter)  # written by save_merged, as a training step is
    assert "model.safetensors" in json.loads((drafter / CHECKSUMS).read_text())
    assert verify_checksums(drafter)
    flip_a_byte(drafter / "model.safetensors")  # in the tensor data: the header stays valid, the size the same
    root = toy_family[0]
    common = [f"drafter.path={drafter}", f"verifier.path={ck(toy_family) / 'verifier'}", f"data.dir={root / 'data'}",
              f"ar_drafter.path={ck(toy_family) / 'ar-drafter'}"]
    for stage in (["eval", "recipes/tiny/eval.yaml", f"eval.out={tmp_path / 'eval'}"],
                  ["export", "recipes/tiny/align.yaml", f"export.out={tmp_path / 'export'}"],
                  ["calibrate", "recipes/tiny/align.yaml", f"calibrate.out={tmp_path / 'graph.json'}"],
                  ["train", "recipes/tiny/align.yaml", f"train.out={tmp_path / 'run'}"]):
        assert align([*stage, *common]) == 2, stage[0]
        said = lines_said(capsys.readouterr().err)
        assert len(said) == 1 and f"{drafter / 'model.safetensors'} is corrupted" in said[0], said
    assert not any((tmp_path / name).exists() for name in ("eval", "export", "graph.json", "run"))
    from align.config import DrafterSection
    from align.drafters.loading import load_drafter

    with pytest.raises(RecipeError, match="model.safetensors is corrupted"):  # the Python API's way in
        load_drafter(DrafterSection(path=str(drafter)))


def test_checksums_follow_a_file_rewritten_after_the_save(tmp_path):
    (tmp_path / "meta.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 64)
    record_checksums(tmp_path)
    (tmp_path / "meta.json").write_text('{"final_tau": 2.0}')  # as record_final_tau does, then records it
    with pytest.raises(RecipeError, match="meta.json is corrupted"):
        verify_checksums(tmp_path)
    record_checksums(tmp_path, ["meta.json"])
    assert verify_checksums(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(RecipeError, match="model.safetensors is missing"):
        verify_checksums(tmp_path)
    assert not verify_checksums(tmp_path / "nonexistent")  # a folder without a record: nothing to check


def test_settings_a_user_edits_on_purpose_are_not_refused_but_a_vocabulary_is(tmp_path):
    for name in ("config.json", "chat_template.jinja", "tokenizer.json", "model.safetensors"):
        (tmp_path / name).write_text("{}")
    record_checksums(tmp_path)
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')  # a longer context, by hand
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")  # a fixed template
    assert verify_checksums(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"x": 1}')
    with pytest.raises(RecipeError, match="tokenizer.json is corrupted"):
        verify_checksums(tmp_path)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_export_refuses_non_finite_weights_before_writing(toy_family, tmp_path, capsys, poison):
    from safetensors.torch import load_file, save_file

    drafter = tmp_path / "poisoned"
    shutil.copytree(ck(toy_family) / "drafter-base", drafter)
    weights = load_file(drafter / "model.safetensors")
    name = sorted(weights)[0]
    weights[name].view(-1)[0] = poison
    save_file(weights, drafter / "model.safetensors", metadata={"format": "pt"})
    record_checksums(drafter)  # its checksums are right: only its values are wrong
    out = tmp_path / "export"
    assert align(["export", "recipes/tiny/align.yaml", f"drafter.path={drafter}", f"export.out={out}"]) == 2
    said = lines_said(capsys.readouterr().err)
    assert len(said) == 1 and f"{drafter / 'model.safetensors'}: {name} holds NaN or infinite" in said[0], said
    assert not out.exists()


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_eval_refuses_non_finite_weights_before_decoding(toy_family, tmp_path, capsys, poison):
    """A NaN drafter decodes greedily (argmax of NaN is an index) and failed only once the sampled run drew from
    it: refused as it loads, naming the file and tensor, before any method runs and before eval.out is written."""
    from safetensors.torch import load_file, save_file

    drafter = tmp_path / "poisoned"
    shutil.copytree(ck(toy_family) / "drafter-base", drafter)
    weights = load_file(drafter / "model.safetensors")
    name = sorted(weights)[-1]
    weights[name].view(-1)[-1] = poison
    save_file(weights, drafter / "model.safetensors", metadata={"format": "pt"})
    (drafter / "sha256.json").unlink()  # the documented route for a deliberate edit
    out = tmp_path / "eval"
    assert align(["eval", "recipes/tiny/eval.yaml", f"drafter.path={drafter}", f"verifier.path={ck(toy_family)}/"
                  "verifier", f"eval.out={out}", "eval.methods=[specdiff]"]) == 2
    said = lines_said(capsys.readouterr().err)  # (the tiny data's build lines may come first, in a fresh checkout)
    assert f"{drafter / 'model.safetensors'}: {name} holds NaN or infinite" in said[-1], said
    assert not (out / "eval.json").exists()


@pytest.mark.parametrize("edit, says", [
    ({"intermediate_size": 1400}, "model.layers.0.mlp.down_proj.weight is (512, 1408) in the checkpoint, (512, 1400) "
                                  "by config.json"),
    ({"num_hidden_layers": 8}, "model.layers.7.input_layernorm.weight has no tensor in the checkpoint"),
    ({"num_hidden_layers": 6}, "model.layers.6.input_layernorm.weight is in the checkpoint but not in the model"),
])
def test_a_config_json_edited_against_its_weights_is_refused_as_the_model_loads(tmp_path, capsys, edit, says):
    """config.json is outside sha256.json (generation settings are the user's to change), and transformers starts
    a weight config.json describes but the checkpoint lacks from random values, with a warning only."""
    verifier = tmp_path / "verifier"
    shutil.copytree(ROOT / "checkpoints" / "tiny" / "verifier", verifier)
    config = json.loads((verifier / "config.json").read_text())
    (verifier / "config.json").write_text(json.dumps({**config, **edit}))
    assert align(["eval", "recipes/tiny/eval.yaml", f"verifier.path={verifier}", f"eval.out={tmp_path / 'eval'}",
                  "eval.methods=[ar]"]) == 2
    said = lines_said(capsys.readouterr().err)
    assert len(said) == 1 and f"{verifier}: config.json does not describe the weights beside it" in said[0], said
    assert says in said[0], said


def test_trajectory_chunks_are_verified_when_read(toy_trajectories, tmp_path):
    from align.data import load_trajectories

    traj = tmp_path / "traj"
    shutil.copytree(toy_trajectories[1], traj)
    arrow = sorted(traj.glob("chunks/*/*.arrow"))[0]
    flip_a_byte(arrow)
    with pytest.raises(RecipeError, match=re.escape(f"{arrow} is missing or corrupted")):
        load_trajectories(traj)


# --------------------------------------------------------------------------------------------------------------------
# appended logs and the DeepSpeed state
# --------------------------------------------------------------------------------------------------------------------
def test_a_cut_last_line_is_dropped_and_cut_off_before_the_next_append(tmp_path, capsys):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')  # died mid-append
    assert [r["step"] for r in read_log(log, "align train")] == [1, 2]
    assert f"align train: warning: {log}: line 3 was cut short" in capsys.readouterr().err
    append_log(log, {"step": 3, "loss": 1.25})
    assert log.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "loss": 1.25}\n'
    assert [r["step"] for r in read_log(log)] == [1, 2, 3] and capsys.readouterr().err == ""


def test_a_damaged_line_inside_a_log_is_named(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(RecipeError, match=re.escape(f"{log}: line 2 is not a JSON record")):
        read_log(log)


def fake_state(state_dir: Path, *steps: int) -> None:
    """DeepSpeed's layout: a folder per tag, committed as train.py commits it."""
    for step in steps:
        (state_dir / f"step_{step}").mkdir(parents=True)
        (state_dir / f"step_{step}" / "mp_rank_00_model_states.pt").write_bytes(bytes(range(256)) * step)
        commit_state(state_dir, f"step_{step}")


def test_which_state_a_run_resumes(tmp_path, capsys):
    state = tmp_path / "ds_state"
    assert state_to_resume(state) is None  # a new run
    (state / "step_2").mkdir(parents=True)  # killed in its first save: nothing was committed
    assert state_to_resume(state) is None
    shutil.rmtree(state)
    fake_state(state, 2, 4)
    assert state_to_resume(state) == "step_4" and capsys.readouterr().err == ""
    (state / "step_6").mkdir()  # killed while DeepSpeed wrote step_6: `latest` still names step_4
    assert state_to_resume(state) == "step_4"
    for text, why in (("", "is empty"), ("step_6", "names step_6, which is not a complete state there"),
                      ("step_9", "names step_9, which is not a complete state there")):
        (state / "latest").write_text(text)
        assert state_to_resume(state) == "step_4"  # the newest complete state
        assert f"{state / 'latest'} {why}; resuming from {state / 'step_4'}" in capsys.readouterr().err
    (state / "latest").unlink()
    assert state_to_resume(state) == "step_4"
    assert "latest is missing; resuming from" in capsys.readouterr().err
    commit_state(state, "step_4")
    flip_a_byte(state / "step_4" / "mp_rank_00_model_states.pt")  # damaged after it was complete: refused
    with pytest.raises(RecipeError, match=re.escape(f"{state / 'step_4' / 'mp_rank_00_model_states.pt'} is corrupted")):
        state_to_resume(state)


def test_a_state_from_before_checksums_still_resumes(tmp_path):
    state = tmp_path / "ds_state"
    (state / "step_3").mkdir(parents=True)
    (state / "latest").write_text("step_3")  # as DeepSpeed itself wrote it
    assert state_to_resume(state) == "step_3"
    (state / "latest").write_text("")
    with pytest.raises(RecipeError, match="latest is empty, and no complete state is left to resume from"):
        state_to_resume(state)


@pytest.fixture(scope="module")
def finished_run(toy_trajectories, tmp_path_factory):
    """(recipe args, run folder) of a finished one-process run: 4 steps, a checkpoint every 2."""
    out = tmp_path_factory.mktemp("finished") / "run"
    recipe = ["recipes/tiny/align.yaml", *overrides(toy_trajectories, out, "train.max_steps=4", "train.save_every=2")]
    done = train(recipe)
    assert done.returncode == 0, done.stderr[-3000:]
    return recipe, out


def train(recipe: list[str], out: Path = None) -> subprocess.CompletedProcess:
    args = [a if out is None or not a.startswith("train.out=") else f"train.out={out}" for a in recipe]
    return subprocess.run([sys.executable, "-m", "align.cli", "train", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))


def test_a_run_whose_metrics_lost_their_last_line_resumes(finished_run, tmp_path):
    recipe, finished = finished_run
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    commit_state(out / "ds_state", "step_2")  # as if killed mid-append of step 4's row, before its checkpoint
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 0.')
    done = train(recipe, out)
    assert done.returncode == 0 and "resuming from step 2" in done.stdout, done.stderr[-3000:]
    assert f"{out / 'metrics.jsonl'}: line 5 was cut short" in done.stderr
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_a_truncated_deepspeed_state_is_named(finished_run, tmp_path):
    recipe, finished = finished_run
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    # A run from before states carried checksums (with them, test_which_state_a_run_resumes: the file is named):
    # DeepSpeed's own error (torch's zip reader), made to name the folder.
    for record in out.glob(f"ds_state/*/{CHECKSUMS}"):
        record.unlink()
    tag = out / "ds_state" / "step_4"
    state = next(tag.glob("*model_states.pt"))
    state.write_bytes(state.read_bytes()[:1000])
    # Two steps further: a finished run is not loaded at all (align train says it has nothing to do).
    done = train([a.replace("train.max_steps=4", "train.max_steps=6") for a in recipe], out)
    said = lines_said(done.stderr)
    assert done.returncode == 2 and len(said) == 1 and f"{tag} cannot be loaded" in said[0], done.stderr[-3000:]


# --------------------------------------------------------------------------------------------------------------------
# a full disk
# --------------------------------------------------------------------------------------------------------------------
def test_writers_that_lose_the_errno_still_name_the_path(tmp_path):
    from safetensors import SafetensorError

    for raised in (OSError(errno.ENOSPC, "No space left on device"),  # f.write, pyarrow, matplotlib: no file name
                   SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
                   RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")):  # torch
        with pytest.raises(OSError) as caught:
            with naming_path(tmp_path / "out"):
                raise raised
        assert caught.value.filename == str(tmp_path / "out")
        assert disk_fault(caught.value).startswith(f"{tmp_path / 'out'}: ")
    with pytest.raises(ValueError):  # anything else passes unchanged
        with naming_path(tmp_path):
            raise ValueError("a bug")
    assert disk_fault(ValueError("a bug")) is None and disk_fault(RuntimeError("shape mismatch")) is None


def no_space_writing(monkeypatch, name: str) -> None:
    """Path.write_text and Dataset.save_to_disk fail as a full disk makes them fail, for files named `name`."""
    real = Path.write_text

    def write_text(self, *args, **kwargs):
        if self.name == name or self.name.startswith(f".{name}."):  # the atomic write's temporary name
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)


def test_a_full_disk_at_export_is_one_line_naming_the_path(toy_family, tmp_path, monkeypatch, capsys):
    no_space_writing(monkeypatch, "README.md")  # the model card: the export's last write
    out = tmp_path / "export"
    assert align(["export", "recipes/tiny/align.yaml", f"drafter.path={ck(toy_family) / 'drafter-base'}",
                  f"export.out={out}"]) == 1
    said = lines_said(capsys.readouterr().err)
    assert len(said) == 1 and said[0].startswith(f"align export: error: {out}: No space left on device"), said
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []  # and no temporary folder left


def test_a_full_disk_at_evals_last_write_keeps_the_results(toy_family, tmp_path, monkeypatch, capsys):
    no_space_writing(monkeypatch, "eval.json")
    root, out = toy_family[0], tmp_path / "eval"
    assert align(["eval", "recipes/tiny/eval.yaml", f"verifier.path={ck(toy_family) / 'verifier'}",
                  f"drafter.path={ck(toy_family) / 'drafter-base'}", f"ar_drafter.path={ck(toy_family) / 'ar-drafter'}",
                  f"data.dir={root / 'data'}", f"eval.out={out}", "eval.num_prompts=2", "decode.max_new_tokens=8", "eval.warmup=0", "eval.methods=[specdiff]",
                  "eval.sampling_temperature=0"]) == 1
    said = lines_said(capsys.readouterr().err)
    assert len(said) == 1 and said[0].startswith(f"align eval: error: {out / 'eval.json'}: No space left"), said
    kept = Path(re.search(r"the result is kept in (\S+):", said[0]).group(1))
    try:
        assert "specdiff" in json.loads(kept.read_text())["methods"]  # nothing measured is lost
    finally:
        kept.unlink()


def test_a_full_disk_while_writing_trajectories_is_one_line(toy_family, tmp_path, monkeypatch, capsys):
    from datasets import Dataset

    def save_to_disk(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")  # as pyarrow reports it: no file name

    monkeypatch.setattr(Dataset, "save_to_disk", save_to_disk)
    root, out = toy_family[0], tmp_path / "traj"
    assert align(["trajectories", "recipes/tiny/align.yaml", f"verifier.path={ck(toy_family) / 'verifier'}",
                  f"data.dir={root / 'data'}", f"trajectories.out={out}", "trajectories.num_prompts=4",
                  *TOY_TRAJECTORIES]) == 1
    said = lines_said(capsys.readouterr().err)
    assert len(said) == 1 and f"error: {out / 'chunks' / 'chunk-00000'}: No space left on device" in said[0], said


# A run whose DeepSpeed state save meets a full disk, as torch's zip writer reports it (no errno, no file name).
FULL_AT_STATE_SAVE = """
import sys, torch
real = torch.save
def save(obj, f, *args, **kwargs):
    if "ds_state" in str(getattr(f, "name", f)):  # a path, or the file object DeepSpeed's state is written into
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    return real(obj, f, *args, **kwargs)
torch.save = save
from align.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_full_disk_at_trains_state_save_is_one_line_and_keeps_the_checkpoint(toy_trajectories, tmp_path):
    out = tmp_path / "run"
    recipe = ["recipes/tiny/align.yaml", *overrides(toy_trajectories, out, "train.max_steps=2", "train.save_every=2")]
    done = subprocess.run([sys.executable, "-c", FULL_AT_STATE_SAVE, "train", *recipe], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    said = lines_said(done.stderr)
    assert done.returncode == 1 and len(said) == 1, done.stderr[-3000:]
    assert said[0].startswith(f"align train: error: {out / 'ds_state' / 'step_2'}: ")
    assert verify_checksums(out / "step_2") and not (out / "ds_state" / "latest").exists()  # nothing half-committed


# --------------------------------------------------------------------------------------------------------------------
# stopping child processes
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
def test_stop_group_ends_grandchildren_and_kills_what_ignores_sigterm(monkeypatch):
    import align.launch
    from align.launch import group_members, start_child, stop_children

    # A child that ignores SIGTERM, with a grandchild (which inherits that) in its group.
    child = start_child(["sh", "-c", "trap '' TERM; sleep 300 & sleep 300; wait"])
    while len(group_members(child.pid)) < 3:
        time.sleep(0.01)
    monkeypatch.setattr(align.launch, "STOP_GRACE_S", 0.2)
    assert stop_children() == 1
    assert group_members(child.pid) == [] and child.returncode == -signal.SIGKILL
