"""Bad input to any stage is refused before the stage starts: one line on stderr naming the key, exit code 2, no
traceback, nothing written (DESIGN §9).

The stages' own `main` functions are replaced by a recorder here, so a refusal that comes too late (from inside a
stage, after it started loading or writing) fails the test, and no test does real work.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import checkout_env

from align.cli import STAGES, main
from align.config import RecipeError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "checkpoints" / "tiny"
VERIFIER, DRAFTER, AR_DRAFTER = TINY / "verifier", TINY / "drafter-base", TINY / "ar-drafter"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)  # the shipped recipes name checkpoints/tiny relative to the repository


def run(*argv: str) -> int:
    try:
        return main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own exits (help, version, its errors)
        return int(e.code or 0)


def refused(capsys, started: list[str], *argv: str) -> str:
    """Run `align <argv>`; assert a one-line refusal with exit 2 before the stage started; return the line."""
    code = run(*argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert not started, f"the stage started before refusing: {err}"
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"align {argv[0]}: error: "), err
    return err.strip()


# --------------------------------------------------------------------------------------------------------------------
# broken model folders, built from the shipped tiny models
# --------------------------------------------------------------------------------------------------------------------
def copy_model(source: Path, dest: Path, weights: bytes | None = None, **config_changes) -> Path:
    """A copy of a model folder (weights linked, not copied, unless `weights` replaces them)."""
    import json

    dest.mkdir(parents=True)
    for f in source.iterdir():
        if f.name == "model.safetensors":
            if weights is None:
                (dest / f.name).symlink_to(f)
            else:
                (dest / f.name).write_bytes(weights)
        else:
            shutil.copy2(f, dest / f.name)
    if config_changes:
        config = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps({**config, **config_changes}))
    return dest


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("broken")
    weights = (DRAFTER / "model.safetensors").read_bytes()
    ar_weights = (AR_DRAFTER / "model.safetensors").read_bytes()
    made = {
        "truncated": copy_model(DRAFTER, root / "truncated", weights[: len(weights) // 2]),
        "bad_header": copy_model(DRAFTER, root / "bad_header", (10**12).to_bytes(8, "little") + weights[8:]),
        "small_vocab": copy_model(DRAFTER, root / "small_vocab", vocab_size=4096),
        "small_vocab_ar": copy_model(AR_DRAFTER, root / "small_vocab_ar", vocab_size=4096),
        "truncated_ar": copy_model(AR_DRAFTER, root / "truncated_ar", ar_weights[:1000]),
        "bad_spec": copy_model(DRAFTER, root / "bad_spec", drafter_spec={"mask_token_id": 2, "logits_shift": 2,
                                                                          "attention": "block_causal"}),
        "mask_outside": copy_model(DRAFTER, root / "mask_outside", drafter_spec={
            "mask_token_id": 9000, "logits_shift": 0, "attention": "block_causal"}),
        "no_weights": copy_model(DRAFTER, root / "no_weights", b""),
    }
    (made["no_weights"] / "model.safetensors").unlink()
    return made


# --------------------------------------------------------------------------------------------------------------------
# 1. every stage's models go through the same checks, before the stage starts
# --------------------------------------------------------------------------------------------------------------------
MODEL_CASES = [
    # stage, recipe, override, expected in the line
    ("train", "align.yaml", f"drafter.path={VERIFIER}", "is the verifier (verifier.path)"),
    ("train", "align.yaml", f"drafter.path={AR_DRAFTER}", "is not a diffusion drafter"),
    ("train", "align.yaml", "drafter.path={small_vocab}", "drafter.path: vocabulary size 4096 differs from the verifier's 8192"),
    ("train", "align.yaml", "drafter.path={truncated}", "model.safetensors is truncated or corrupt"),
    ("calibrate", "spiffy.yaml", f"drafter.path={VERIFIER}", "is the verifier"),
    ("calibrate", "spiffy.yaml", f"drafter.path={AR_DRAFTER}", "is not a diffusion drafter"),
    ("calibrate", "spiffy.yaml", "drafter.path={truncated}", "model.safetensors is truncated or corrupt"),
    ("eval", "eval.yaml", f"drafter.path={AR_DRAFTER}", "is not a diffusion drafter"),
    ("eval", "eval.yaml", "drafter.path={bad_header}", "model.safetensors is truncated or corrupt"),
    ("eval", "eval.yaml", "eval.compare_drafters={{other: {truncated}}}", "eval.compare_drafters.other: "),
    ("eval", "eval.yaml", "ar_drafter.path={small_vocab_ar}", "ar_drafter.path: vocabulary size 4096 differs"),
    ("eval", "spiffy.yaml", f"drafter.path={AR_DRAFTER}", "is not a diffusion drafter"),  # eval.mode=dllm
    ("export", "eval.yaml", f"drafter.path={VERIFIER}", "is the verifier"),
    ("export", "eval.yaml", "drafter.path={bad_spec}", "drafter.path: "),
    ("gkd", "align.yaml", "ar_drafter.path={truncated_ar}", "ar_drafter.path: "),
    ("gkd", "align.yaml", f"ar_drafter.path={DRAFTER}", "is a diffusion drafter"),
    ("gkd", "align.yaml", "ar_drafter.path={small_vocab_ar}", "ar_drafter.path: vocabulary size 4096 differs"),
    ("trajectories", "align.yaml", "verifier.path={truncated}", "verifier.path: "),
    ("trajectories", "align.yaml", f"verifier.path={DRAFTER}", "is a diffusion drafter"),
    ("eval", "eval.yaml", "drafter.path={mask_outside}", "mask_token_id 9000 is outside the vocabulary"),
    ("eval", "eval.yaml", "drafter.path={no_weights}", "has no weights"),
]


@pytest.mark.parametrize("stage, recipe, override, expected", MODEL_CASES,
                         ids=[f"{c[0]}-{c[2].split('=')[0]}-{i}" for i, c in enumerate(MODEL_CASES)])
def test_bad_model_is_refused_before_the_stage(capsys, started, broken, stage, recipe, override, expected):
    line = refused(capsys, started, stage, f"recipes/tiny/{recipe}", override.format(**broken))
    assert expected in line


def test_truncated_file_is_named(capsys, started, broken):
    line = refused(capsys, started, "train", "recipes/tiny/align.yaml", f"drafter.path={broken['truncated']}")
    assert str(broken["truncated"] / "model.safetensors") in line


def test_the_verifier_is_not_a_drafter_even_with_a_spec(capsys, started):
    # With the spec given in the recipe, an AR model can be read as a drafter; the verifier itself never is.
    line = refused(capsys, started, "train", "recipes/tiny/align.yaml", f"drafter.path={VERIFIER}",
                   "drafter.mask_token_id=2", "drafter.logits_shift=0", "drafter.attention=block_causal")
    assert "drafter.path: " in line and "is the verifier" in line


@pytest.mark.parametrize("stage, recipe", [("train", "align.yaml"), ("calibrate", "spiffy.yaml"), ("eval", "eval.yaml"),
                                           ("eval", "spiffy.yaml"), ("export", "eval.yaml"), ("gkd", "align.yaml"),
                                           ("trajectories", "align.yaml"), ("bootstrap", "bootstrap.yaml")])
def test_shipped_models_pass_the_checks(capsys, started, tmp_path, stage, recipe):
    extra = []
    if (stage, recipe) == ("eval", "spiffy.yaml"):  # dllm eval decodes with a calibrated graph, given as the README does
        from align.draft_graph import DraftGraph

        DraftGraph(tuple(frozenset((i, 1) for i in range(1, k + 1)) for k in range(1, 11)), 32).save(
            tmp_path / "draft_graph.json")
        extra = [f"calibrate.graph={tmp_path / 'draft_graph.json'}"]
    assert run(stage, f"recipes/tiny/{recipe}", *extra) == 0, capsys.readouterr().err
    assert started == [stage]


def test_check_weights_reads_only_the_header(tmp_path):
    from align.preflight import check_weights

    check_weights("drafter.path", DRAFTER)
    weights = (DRAFTER / "model.safetensors").read_bytes()
    for name, data in {"short": weights[:4], "header": weights[:100], "data": weights[:-1],
                       "longer": weights + b"\0", "json": (5).to_bytes(8, "little") + b"{nope"}.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(data)
        with pytest.raises(RecipeError, match=rf"^drafter.path: {folder / 'model.safetensors'} is truncated or corrupt"):
            check_weights("drafter.path", folder)


def test_sharded_weights_name_a_missing_shard(tmp_path):
    import json

    from align.preflight import check_weights

    folder = copy_model(DRAFTER, tmp_path / "sharded")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(RecipeError, match="model-00002-of-00002.safetensors is missing"):
        check_weights("drafter.path", folder)


# --------------------------------------------------------------------------------------------------------------------
# 2. output paths
# --------------------------------------------------------------------------------------------------------------------
OUTPUT_CASES = [
    ("bootstrap", "bootstrap.yaml", "bootstrap.out"), ("bootstrap", "bootstrap.yaml", "data.dir"),
    ("trajectories", "align.yaml", "trajectories.out"), ("train", "align.yaml", "train.out"),
    ("gkd", "align.yaml", "gkd.out"), ("calibrate", "spiffy.yaml", "calibrate.out"), ("eval", "eval.yaml", "eval.out"),
    ("export", "eval.yaml", "export.out"),
]


@pytest.mark.parametrize("stage, recipe, key", OUTPUT_CASES)
def test_output_that_is_a_file_is_refused(capsys, started, tmp_path, stage, recipe, key):
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    line = refused(capsys, started, stage, f"recipes/tiny/{recipe}", f"{key}={precious}")
    assert line.startswith(f"align {stage}: error: {key}: ") and "is an existing file" in line
    line = refused(capsys, started, stage, f"recipes/tiny/{recipe}", f"{key}={precious / 'run'}")
    assert line.startswith(f"align {stage}: error: {key}: ") and "is a file" in line
    assert precious.read_text() == "keep me" and sorted(tmp_path.iterdir()) == [precious]


@pytest.mark.parametrize("stage, recipe", [("trajectories", "align.yaml"), ("calibrate", "spiffy.yaml"),
                                           ("eval", "eval.yaml")])
def test_data_dir_that_is_a_file(capsys, started, tmp_path, stage, recipe):
    # These stages build the tiny data in data.dir when it is missing; a read-only data.dir is fine, a file is not.
    (tmp_path / "data").write_text("not a folder")
    line = refused(capsys, started, stage, f"recipes/tiny/{recipe}", f"data.dir={tmp_path / 'data'}")
    assert line.startswith(f"align {stage}: error: data.dir: ") and "is an existing file" in line
    # A complete data.dir need not be writable; a folder align did not write (here one even root cannot write) is
    # refused whatever its permissions, since the stage would build the tiny data into it.
    from align.disk import mark_folder

    ready = mark_folder(tmp_path / "ready", "data")
    (ready / "manifest.json").write_text('{"corpus_hash": "..."}')
    ready.chmod(0o555)
    assert run(stage, f"recipes/tiny/{recipe}", f"data.dir={ready}") == 0 and started == [stage]
    if os.geteuid() == 0 and not os.access("/proc/self", os.W_OK):
        line = refused(capsys, [], stage, f"recipes/tiny/{recipe}", "data.dir=/proc/self")
        assert "data.dir: /proc/self is not empty and align did not write it" in line, line


def test_output_under_a_folder_that_cannot_be_written(capsys, started, tmp_path):
    # Root ignores permission bits, so a chmod'ed folder only refuses others; /proc/self refuses even root.
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
    elif os.access("/proc/self", os.W_OK):
        pytest.skip("no folder here that root cannot write to")
    else:
        locked = Path("/proc/self")
    line = refused(capsys, started, "eval", "recipes/tiny/eval.yaml", f"eval.out={locked / 'eval'}")
    assert line == f"align eval: error: eval.out: {locked} is not writable (needed to create {locked / 'eval'})"


def test_check_output_uses_access(tmp_path, monkeypatch):
    from align.preflight import check_output

    check_output("train.out", str(tmp_path / "a" / "b"))  # a new folder under a writable one
    check_output("train.out", str(tmp_path))  # an existing folder
    monkeypatch.setattr(os, "access", lambda *_: False)
    with pytest.raises(RecipeError, match=rf"^train.out: {tmp_path} is not writable$"):
        check_output("train.out", str(tmp_path))


def test_dangling_link_output(tmp_path, capsys, started):
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    line = refused(capsys, started, "eval", "recipes/tiny/eval.yaml", f"eval.out={tmp_path / 'link'}")
    assert "eval.out: " in line and "dangling" in line


# --------------------------------------------------------------------------------------------------------------------
# 3. Ctrl-C
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    # A stand-in for a long stage: the real cli, with the eval stage's module replaced by one that waits.
    script = tmp_path / "slow.py"
    script.write_text(
        "import sys, time, types, dataclasses\n"
        "slow = types.ModuleType('slow_stage')\n"
        "def wait(recipe, command):\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
        "slow.main = wait\n"
        "sys.modules['slow_stage'] = slow\n"
        "from align import cli\n"
        "cli.STAGES['eval'] = dataclasses.replace(cli.STAGES['eval'], module='slow_stage')\n"
        "raise SystemExit(cli.main(sys.argv[1:]))\n"
    )
    env = checkout_env(HF_HUB_OFFLINE="1")
    # The child starts with Ctrl-C's default disposition, as from a terminal: an ignored SIGINT in this process (which
    # a library may set) would be inherited, and Python then installs no KeyboardInterrupt handler at all.
    proc = subprocess.Popen([sys.executable, str(script), "eval", "recipes/tiny/eval.yaml",
                             f"eval.out={tmp_path / 'out'}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert err == "align eval: interrupted\n"


# --------------------------------------------------------------------------------------------------------------------
# 7. a new user's mistakes: each one line, exit 2
# --------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("files")
    made = {"empty": "", "comments": "# nothing here\n", "list": "- a\n- b\n", "binary": b"\xff\xfe\x00bad",
            "section_value": "train: 5\n", "bad_type": "train:\n  lr: fast\n", "dir": None, "file": "x\n",
            "bad_config": None, "list_config": None, "no_model_type": None}
    paths = {}
    for name, content in made.items():
        path = root / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
        paths[name] = path
    paths["dir"].mkdir()
    copy_model(DRAFTER, paths["bad_config"])
    (paths["bad_config"] / "config.json").write_text('{"model_type": "llama", ')
    copy_model(VERIFIER, paths["list_config"])
    (paths["list_config"] / "config.json").write_text("[]")
    copy_model(DRAFTER, paths["no_model_type"])
    (paths["no_model_type"] / "config.json").write_text('{"vocab_size": 8192}')
    return paths


NEW_USER_CASES = [
    # stage, recipe (or {name} of a file above), overrides, expected in the line
    ("validate", "{empty}", [], "empty recipe"),
    ("validate", "{comments}", [], "empty recipe"),
    ("validate", "{list}", [], "a recipe is a mapping of sections, got list"),
    ("validate", "{dir}", [], "is a folder, not a recipe file"),
    ("validate", "{binary}", [], "not UTF-8 text"),
    ("validate", "{section_value}", [], "train: "),
    ("validate", "{bad_type}", [], "train.lr: "),
    ("validate", "recipes/tiny/eval.yaml", ["decode.temperature=.inf"], "decode.temperature: Input should be a finite number"),
    ("validate", "recipes/tiny/eval.yaml", ["train.lr=.nan"], "train.lr: "),
    # logits ÷ 1e-300 overflowed: the sampled run died after the greedy one (issue 35)
    ("eval", "recipes/tiny/eval.yaml", ["eval.sampling_temperature=1e-300"],
     "eval.sampling_temperature: a temperature is 0 (greedy) or at least 1e-05"),
    ("validate", "recipes/tiny/eval.yaml", ["decode.draft_temperature=1e-9"],
     "decode.draft_temperature: a drafting temperature is at least 1e-05"),
    ("validate", "recipes/tiny/eval.yaml", ["data.test_prompts=x.jsonl"], "unknown key 'data.test_prompts'"),
    ("eval", "recipes/tiny/eval.yaml", ["eval.methods=[nope]"], "eval.methods[0]: "),
    ("eval", "recipes/tiny/eval.yaml", ["eval.prompts={dir}"], "eval.prompts: "),
    ("eval", "recipes/tiny/eval.yaml", ["drafter.path={bad_config}"], "drafter.path: cannot read "),
    ("eval", "recipes/tiny/eval.yaml", ["verifier.path={list_config}"], "verifier.path: cannot read "),
    ("eval", "recipes/tiny/eval.yaml", ["drafter.path={no_model_type}"], "drafter.path: cannot read "),
    ("eval", "recipes/tiny/eval.yaml", ["drafter.path={file}"], "drafter.path: "),
    ("eval", "recipes/tiny/eval.yaml", [f"drafter.path={TINY / 'tokenizer'}"], "has no config.json"),
    ("eval", "recipes/tiny/eval.yaml", ["eval.out={file}"], "eval.out: "),
    ("train", "recipes/tiny/align.yaml", ["train.lr=1e6"], "train.lr: "),
    # An empty mapping once passed and the first step crashed on every rank with a traceback.
    ("train", "recipes/tiny/align.yaml", ["train.losses={{}}"], "train.losses: "),
    ("train", "recipes/tiny/align.yaml", ["train.losses={{ce_streak: 0}}"], "train.losses.ce_streak: "),
    # The verifier-states cache holds the verifier's states at the true prefix: a step that runs it on new inputs
    # cannot use it.
    ("train", "recipes/tiny/dflash.yaml", ["train.cache_verifier_states=true", "train.data_mode=on_policy"],
     "train.cache_verifier_states: with train.data_mode=on_policy"),
    # Precomputed states (align states) are the verifier's at the true prefix too, and make the cache moot; a states
    # folder not yet written is named before launching.
    ("train", "recipes/tiny/dflash.yaml", ["states.out=/tmp/s", "train.data_mode=on_policy"],
     "states.out: with train.data_mode=on_policy"),
    ("train", "recipes/tiny/dflash.yaml", ["states.out=/tmp/s", "train.cache_verifier_states=true"],
     "train.cache_verifier_states: states.out holds"),
    ("train", "recipes/tiny/align.yaml", ["states.out=/tmp/s"], "states.out: only a DFlash drafter"),
    ("states", "recipes/tiny/dflash.yaml", [], "states.out: set the folder"),
    ("states", "recipes/tiny/align.yaml", ["states.out=/tmp/s"], "states.out: only a DFlash drafter"),
    ("train", "recipes/tiny/dflash.yaml", ["dflash.draft_vocab_size=100000"], "dflash.draft_vocab_size: 100000 is more"),
    # Refused after train.py had written .align and run.json, which then refused the corrected rerun (issue 35).
    ("train", "recipes/tiny/dflash.yaml", ["dflash.aux_layer_ids=[1, 30]"], "dflash.aux_layer_ids: [1, 30] must be"),
    ("train", "recipes/tiny/dflash.yaml", ["train.activation_checkpointing=true"],
     "train.activation_checkpointing: the DFlash drafter does not support"),
    # A block drafting fewer tokens than train.gamma trained positions vLLM and eval would never draft (issue 35).
    ("train", "recipes/tiny/dflash.yaml", ["dflash.block_size=3", "train.gamma=4"],
     "train.gamma: 4 draft positions, but a block of dflash.block_size 3 drafts 2"),
    ("train", "recipes/tiny/align.yaml", ["train.max_steps=true"], "train.max_steps: expects a number, not a boolean"),
    ("export", "recipes/tiny/align.yaml", ["--revision", "v1"], "export.revision: set, but nothing is pushed"),
    ("evl", "recipes/tiny/eval.yaml", [], "invalid choice"),
    ("eval", None, [], "the following arguments are required: recipe"),
    ("eval", "recipes/tiny/eval.yaml", ["--num_gpus", "2"], "unrecognized arguments: --num_gpus"),
]


@pytest.mark.parametrize("stage, recipe, overrides, expected", NEW_USER_CASES,
                         ids=[f"{i}-{c[0]}-{(c[2] or [c[1]])[0]}" for i, c in enumerate(NEW_USER_CASES)])
def test_new_user_mistakes(capsys, started, files, stage, recipe, overrides, expected):
    argv = [stage] + ([recipe.format(**files)] if recipe else []) + [o.format(**files) for o in overrides]
    code = run(*argv)
    err = capsys.readouterr().err
    assert code == 2 and not started, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    prefix = "align: error: " if stage not in STAGES else f"align {stage}: error: "
    assert err.startswith(prefix) and expected in err, err


@pytest.mark.slow
@pytest.mark.parametrize("content, why", [
    (b'{"prompt": "caf\xe9"}\n', "is not UTF-8 text (byte 15)"),  # Latin-1
    (b'{"prompt": "a"}\n{bad json\n', "cannot read"),
])
def test_a_bad_prompt_file_is_one_line(tmp_path, content, why):
    bad = tmp_path / "prompts.jsonl"
    bad.write_bytes(content)
    # A subprocess: datasets logs through a handler bound to the real stderr, which capsys would not see.
    proc = subprocess.run([sys.executable, "-m", "align.cli", "eval", "recipes/tiny/eval.yaml", f"eval.prompts={bad}",
                           f"eval.out={tmp_path / 'out'}"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("align eval: error: eval.prompts: ") and why in proc.stderr


# --------------------------------------------------------------------------------------------------------------------
# 8. prompt sources (files, Hub-layout folders, Hub ids) and chat templates: refused by the cli, before the stage
# --------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> dict[str, Path]:
    from datasets import Dataset

    root = tmp_path_factory.mktemp("chats")
    messages = [{"role": "user", "content": "def f():"}, {"role": "assistant", "content": "    pass"}]
    hub = root / "hub"
    (hub / "data").mkdir(parents=True)
    for split in ("train", "test"):
        Dataset.from_list([{"messages": messages, "prompt": "def f():"}]).to_parquet(
            str(hub / "data" / f"{split}-00000-of-00001.parquet"))
    malformed = root / "malformed.jsonl"
    malformed.write_text('{"messages": [{"role": "user", "content": "a"}]}\n{"messages": [{"role": "user"}]}\n')
    answers = root / "answers.jsonl"
    answers.write_text('{"messages": [{"role": "assistant", "content": "a"}]}\n')
    numbers = root / "numbers.jsonl"
    numbers.write_text('{"prompt": 3}\n')
    return {"hub": hub, "malformed": malformed, "answers": answers, "numbers": numbers}


PROMPT_CASES = [
    # stage, recipe, overrides, expected in the line
    ("trajectories", "align", ["data.train_prompts=/nonexistent/chats"], "data.train_prompts: no such file or folder"),
    # org/name-shaped, but a file's name: no Hub look-up
    ("trajectories", "align", ["data.train_prompts=nonexistent/p.parquet"], "data.train_prompts: no such file: "),
    ("trajectories", "align", ["data.train_prompts={hub}", "data.prompt_column=text"],
     "data.prompt_column: {hub} has no 'text' field (fields: messages, prompt)"),
    ("trajectories", "align", ["data.train_prompts={hub}", "data.train_split=validation"],
     "data.train_split: {hub} has no split 'validation' (splits: train, test)"),
    ("trajectories", "align", ["data.chat_template=on"], "data.chat_template: on, but the tokenizer of "),
    ("trajectories", "align", ["data.train_prompts={malformed}", "data.prompt_column=messages"],
     "data.prompt_column: row 1 of {malformed}: message 0 is not a {{role, content}} of strings"),
    ("trajectories", "align", ["data.train_prompts={answers}", "data.prompt_column=messages"],
     "holds only assistant turns"),
    ("trajectories", "align", ["data.train_prompts={numbers}"], "neither a string nor a list of chat messages"),
    # the tiny verifier's tokenizer has no chat template: messages cannot become a prompt
    ("trajectories", "align", ["data.train_prompts={hub}", "data.prompt_column=messages"],
     "data.prompt_column: {hub} holds chat messages, which need a chat template (the tokenizer of "),
    ("eval", "eval", ["eval.prompts={hub}", "eval.prompt_column=messages", "data.chat_template=off"],
     "eval.prompt_column: {hub} holds chat messages, which need a chat template (data.chat_template=off)"),
    ("eval", "eval", ["eval.prompts=nobody/no-such-dataset"], "eval.prompts: nobody/no-such-dataset is not a local "
     "file or folder, and the Hub is offline"),
    ("eval", "eval", ["eval.prompts={hub}", "eval.split=validation"], "eval.split: "),
    ("calibrate", "spiffy", ["calibrate.prompts={hub}", "calibrate.prompt_column=text"], "calibrate.prompt_column: "),
    ("calibrate", "spiffy", ["data.chat_template=on"], "the tokenizer of checkpoints/tiny/drafter-base has no chat"),
]


@pytest.mark.parametrize("stage, recipe, overrides, expected", PROMPT_CASES,
                         ids=[f"{i}-{c[0]}-{c[2][-1].split('=')[0]}" for i, c in enumerate(PROMPT_CASES)])
def test_bad_prompt_sources(capsys, started, chats, tmp_path, stage, recipe, overrides, expected):
    names = {k: str(v) for k, v in chats.items()}
    out = {"trajectories": "trajectories.out", "eval": "eval.out", "calibrate": "calibrate.out"}[stage]
    line = refused(capsys, started, stage, f"recipes/tiny/{recipe}.yaml", *(o.format(**names) for o in overrides),
                   f"{out}={tmp_path / 'out'}")
    assert expected.format(**names) in line, line


def test_good_prompt_sources_pass_the_checks(capsys, started, chats, tmp_path):
    assert run("trajectories", "recipes/tiny/align.yaml", f"data.train_prompts={chats['hub']}",
               f"trajectories.out={tmp_path / 'out'}") == 0, capsys.readouterr().err
    assert run("eval", "recipes/tiny/eval.yaml", f"eval.prompts={chats['hub']}", "eval.prompt_column=prompt",
               f"eval.out={tmp_path / 'out'}") == 0, capsys.readouterr().err
    assert started == ["trajectories", "eval"]


@pytest.fixture(scope="module")
def not_tiny(tmp_path_factory) -> dict[str, Path]:
    """Copies of the tiny verifier and drafter that are not of the tiny family: without bootstrap's manifest, and
    with two tokens' ids swapped (the vocabulary size, and so every other check, is unchanged)."""
    import json

    root = tmp_path_factory.mktemp("not_tiny")
    made = {"verifier": copy_model(VERIFIER, root / "verifier"), "drafter": copy_model(DRAFTER, root / "drafter")}
    for folder in made.values():
        (folder / "manifest.json").unlink(missing_ok=True)
        tokenizer = json.loads((folder / "tokenizer.json").read_text())
        vocab = tokenizer["model"]["vocab"]
        first, second = (w for w, _ in zip(sorted(vocab, key=vocab.get)[300:], range(2)))
        vocab[first], vocab[second] = vocab[second], vocab[first]
        (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return made


TINY_DEFAULT_CASES = [
    # stage, recipe, overrides, the key named
    ("trajectories", "align", ["verifier.path={verifier}"], "data.train_prompts"),
    ("eval", "eval", ["verifier.path={verifier}", "drafter.path={drafter}", "eval.methods=[ar]"], "eval.prompts"),
    ("eval", "eval", ["verifier.path={verifier}", "drafter.path={drafter}", "eval.prompts={prompts}",
                      "eval.methods=[ar, specdiff_cps]"], "decode.cps_proxy_corpus"),
    ("calibrate", "spiffy", ["drafter.path={drafter}"], "calibrate.prompts"),
]


@pytest.mark.parametrize("stage, recipe, overrides, key", TINY_DEFAULT_CASES,
                         ids=[c[3] for c in TINY_DEFAULT_CASES])
def test_tiny_defaults_are_refused_for_a_model_of_another_family(capsys, started, not_tiny, chats, tmp_path, stage,
                                                                  recipe, overrides, key):
    """issue 26: a real model with a recipe that leaves the prompts (or the CPS proxy's corpus) unset would run on the
    tiny family's standard-library data; it is refused before the stage starts, naming the key to set."""
    names = {**{k: str(v) for k, v in not_tiny.items()}, "prompts": str(chats["hub"])}
    out = {"trajectories": "trajectories.out", "eval": "eval.out", "calibrate": "calibrate.out"}[stage]
    line = refused(capsys, started, stage, f"recipes/tiny/{recipe}.yaml", *(o.format(**names) for o in overrides),
                   "eval.prompt_column=prompt", f"{out}={tmp_path / 'out'}")
    assert f"error: {key}: not set" in line and "is not a tiny-family model" in line, line


# --------------------------------------------------------------------------------------------------------------------
# 9. files other stages wrote, and configs, checked before any work (issue 24: findings 7, 10, 11)
# --------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dflash_drafter(tmp_path_factory) -> Path:
    """A DFlash drafter (random weights) on the shipped tiny verifier, saved as align train saves one."""
    import torch

    from align.checkpoint import save_merged
    from align.config import DFlashSection, VerifierSection
    from align.models import load_tokenizer
    from align.drafters.loading import new_dflash_drafter

    section = VerifierSection(path=str(VERIFIER), device="cpu", dtype="float32")
    tokenizer = load_tokenizer(str(VERIFIER))
    torch.manual_seed(0)
    drafter, _ = new_dflash_drafter(section, DFlashSection(intermediate_size=64), section, tokenizer.mask_token_id, 4)
    folder = tmp_path_factory.mktemp("dflash") / "step_1"
    save_merged(drafter, tokenizer, folder, {})
    return folder


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> dict[str, Path]:
    """eval.json and draft_graph.json files that are not what their readers expect."""
    import json

    root = tmp_path_factory.mktemp("bad_files")
    contents = {
        "not_json.json": "{nope", "list.json": "[1, 2]", "no_methods.json": json.dumps({"meta": {}}),
        "empty_methods.json": json.dumps({"methods": {}}),
        "row_not_object.json": json.dumps({"methods": {"ar": 1.0}}),
        "null_exact.json": json.dumps({"methods": {"ar": {"tau": 1.0, "speedup": 1.0, "exact_match": None}}}),
        "no_exact.json": json.dumps({"methods": {"ar": {"tau": 1.0, "speedup": 1.0}}}),
        "no_tau.json": json.dumps({"methods": {"ar": {"speedup": 1.0, "exact_match": 1.0}}}),
        "string_tau.json": json.dumps({"methods": {"ar": {"tau": "fast", "speedup": 1.0, "exact_match": 1.0}}}),
        "graph.json": json.dumps({"version": 1, "nodes": "oops"}),
    }
    for name, text in contents.items():
        (root / name).write_text(text)
    (root / "folder.json").mkdir()
    return {name.removesuffix(".json"): root / name for name in [*contents, "folder.json"]}


@pytest.mark.parametrize("name, why", [
    ("not_json", "not readable JSON"), ("list", "no `methods` object"), ("no_methods", "no `methods` object"),
    ("empty_methods", "`methods` is empty"), ("row_not_object", "methods.ar is not an object"),
    ("no_tau", "methods.ar.tau is null, a number is expected"),
    ("string_tau", 'methods.ar.tau is "fast", a number is expected'), ("folder", "is a folder"),
])
def test_export_eval_that_is_no_eval_json_is_refused_before_the_stage(capsys, started, bad_files, tmp_path, name,
                                                                      why):
    line = refused(capsys, started, "export", "recipes/tiny/eval.yaml", f"export.eval={bad_files[name]}",
                   f"export.out={tmp_path / 'export'}")
    assert line.startswith("align export: error: export.eval: ") and why in line, line
    assert not (tmp_path / "export").exists()


def test_export_refuses_a_checkpoint_whose_meta_json_is_unreadable(capsys, started, tmp_path):
    drafter = copy_model(DRAFTER, tmp_path / "step_3")
    (drafter / "meta.json").write_text('{"step": 3, "reci')  # cut short
    line = refused(capsys, started, "export", "recipes/tiny/eval.yaml", f"drafter.path={drafter}",
                   f"export.out={tmp_path / 'export'}")
    assert line.startswith(f"align export: error: drafter.path: {drafter / 'meta.json'} is not a JSON object"), line


@pytest.mark.parametrize("stage, recipe", [("export", "eval.yaml"), ("eval", "spiffy.yaml")])
def test_a_malformed_draft_graph_is_refused_before_the_stage(capsys, started, bad_files, tmp_path, stage, recipe):
    line = refused(capsys, started, stage, f"recipes/tiny/{recipe}", f"calibrate.graph={bad_files['graph']}",
                   f"{stage}.out={tmp_path / 'out'}")
    assert f"calibrate.graph: {bad_files['graph']}: " in line, line


@pytest.mark.parametrize("name, why", [
    ("null_exact", "methods.ar.exact_match is null, a number is expected"),
    ("no_exact", "methods.ar.exact_match is null, a number is expected"),
    ("not_json", "not readable JSON"), ("row_not_object", "methods.ar is not an object"), ("folder", "is a folder"),
])
def test_exact_refuses_an_eval_json_it_cannot_judge(capsys, bad_files, name, why):
    assert run("exact", bad_files[name]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("align exact: error: ") and why in captured.err and captured.err.count("\n") == 1
    assert captured.out == ""  # nothing half-reported before the refusal


@pytest.mark.parametrize("argv, why", [
    (["--context", "0"], "argument --context: an integer >= 1 is expected, got '0'"),
    (["--max-tokens", "-3"], "argument --max-tokens: an integer >= 1 is expected, got '-3'"),
    (["--rounds", "0"], "argument --rounds: an integer >= 1 is expected, got '0'"),
    (["--rounds", "two"], "argument --rounds: an integer >= 1 is expected, got 'two'"),
    (["--context", "4000"], "--context 4000 + --max-tokens 64 exceeds "),
    (["--out", "{tmp}"], "--out: {tmp} is a folder; --out names a JSON file"),
    (["--out", "{tmp}/file/costs.json"], "--out: {tmp}/file/costs.json cannot be created ({tmp}/file is not a writable folder)"),
])
def test_verify_costs_refuses_bad_arguments_before_the_benchmark(capsys, monkeypatch, tmp_path, argv, why):
    import align.bench

    monkeypatch.setattr(align.bench, "verify_cost_curves", lambda *a, **k: pytest.fail("the benchmark started"))
    (tmp_path / "file").write_text("keep")
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert run("verify-costs", VERIFIER, "--device", "cpu", *argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("align verify-costs: error: ") and why.format(tmp=tmp_path) in err, err
    assert err.count("\n") == 1 and (tmp_path / "file").read_text() == "keep"


def test_throughput_refuses_a_negative_warm_up(capsys, tmp_path):
    assert run("throughput", tmp_path, "--warmup-steps", "-1") == 2
    assert "argument --warmup-steps: an integer >= 0 is expected, got '-1'" in capsys.readouterr().err


def test_speculators_export_of_a_standalone_drafter_is_refused_from_its_config(capsys, started, tmp_path):
    line = refused(capsys, started, "export", "recipes/tiny/eval.yaml", "export.format=speculators",
                   f"export.out={tmp_path / 'export'}")
    assert "export.format: speculators takes a DFlash drafter; " in line and "standalone" in line


def test_self_selection_with_a_dflash_drafter_is_refused_from_its_config(capsys, started, dflash_drafter, tmp_path):
    line = refused(capsys, started, "eval", "recipes/tiny/eval.yaml", f"drafter.path={dflash_drafter}",
                   "eval.methods=[specdiff, specdiff2_select]", f"eval.out={tmp_path / 'eval'}")
    assert line.startswith("align eval: error: eval.methods: specdiff2_select does not run a DFlash drafter"), line
    assert run("eval", "recipes/tiny/eval.yaml", f"drafter.path={dflash_drafter}", "eval.methods=[specdiff]",
               f"eval.out={tmp_path / 'eval'}") == 0 and started == ["eval"]


def test_each_drafter_kind_runs_or_refuses_every_drafter_method():
    # align/drafters/spec.py's one table: what a kind runs and what it refuses cover the methods that read drafter.path.
    from align.decoding.options import METHOD_MODELS
    from align.drafters.spec import DRAFTER_KINDS, REFUSED_METHODS, kind_methods

    drafted = {m for m, keys in METHOD_MODELS.items() if "drafter.path" in keys}
    assert set(REFUSED_METHODS) == set(DRAFTER_KINDS)
    for kind in DRAFTER_KINDS:
        assert set(kind_methods(kind)) | set(REFUSED_METHODS[kind]) == drafted, kind
        assert not set(kind_methods(kind)) & set(REFUSED_METHODS[kind]), kind
    assert "specdiff2_select" in REFUSED_METHODS["dflash"] and "specdiff_tree" in kind_methods("dflash")


@pytest.mark.parametrize("stage, recipe, key", [
    ("trajectories", "align.yaml", "trajectories.max_new_tokens"), ("eval", "eval.yaml", "decode.max_new_tokens"),
    ("eval", "spiffy.yaml", "decode.max_new_tokens"), ("calibrate", "spiffy.yaml", "decode.max_new_tokens"),
    ("gkd", "align.yaml", "gkd.max_new_tokens"),
])
def test_new_tokens_that_fill_the_context_are_refused_from_the_configs(capsys, started, tmp_path, stage, recipe, key):
    line = refused(capsys, started, stage, f"recipes/tiny/{recipe}", f"{key}=1024", "calibrate.graph=null",
                   f"{stage}.out={tmp_path / 'out'}")
    assert line.startswith(f"align {stage}: error: {key}: 1024 new tokens leave no room for a prompt"), line


@pytest.fixture
def long_prompt(tmp_path) -> Path:
    path = tmp_path / "long.jsonl"
    path.write_text('{"prompt": "' + "def f(): return 1\\n" * 300 + '"}\n')
    return path


@pytest.fixture
def no_weights(monkeypatch) -> list[str]:
    """Model weights loaded by any stage (none may be for input refused from configs)."""
    import align.stages.calibrate
    import align.stages.evaluate.dllm
    import align.stages.trajectories

    loaded: list[str] = []
    for module in (align.stages.trajectories, align.stages.calibrate, align.stages.evaluate.dllm):
        for name in ("load_verifier", "load_drafter"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, lambda *a, name=name, **k: loaded.append(name) or pytest.fail(
                    f"{name} was called before the refusal"))
    return loaded


@pytest.mark.parametrize("stage, recipe, key, expected", [
    # trajectories once sampled past the verifier's context (eval refused the same prompts); calibrate refused only
    # after loading the drafter when every prompt was too long
    ("trajectories", "align.yaml", "data.train_prompts", "data.train_prompts: prompt 0 has "),
    ("calibrate", "spiffy.yaml", "calibrate.prompts", "calibrate.prompts: every prompt of "),
])
def test_prompts_past_the_context_are_refused_before_weights_load(capsys, no_weights, long_prompt, tmp_path, stage,
                                                                  recipe, key, expected):
    out = tmp_path / "out"
    assert run(stage, f"recipes/tiny/{recipe}", f"{key}={long_prompt}", f"{stage}.out={out}") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"align {stage}: error: {expected}") and err.count("\n") == 1, err
    assert not out.exists() and not no_weights


def test_dllm_eval_refuses_a_too_long_prompt_before_weights_load(capsys, no_weights, long_prompt, tmp_path):
    from align.draft_graph import DraftGraph

    graph = tmp_path / "graph.json"
    DraftGraph((frozenset({(1, 1)}),), block_length=32).save(graph)
    assert run("eval", "recipes/tiny/spiffy.yaml", f"eval.prompts={long_prompt}", f"calibrate.graph={graph}",
               "eval.spiffy_budgets=[1]", f"eval.out={tmp_path / 'out'}") == 2
    err = capsys.readouterr().err
    assert "eval.prompts: prompt 0 has " in err and err.count("\n") == 1 and not no_weights, err


@pytest.fixture(scope="module")
def toy(toy_trajectories, tmp_path_factory) -> dict[str, Path]:
    """The toy family and trajectories, with a drafter and an AR drafter whose context is shorter than the rows."""
    root, traj = toy_trajectories
    short = tmp_path_factory.mktemp("short")
    return {"root": root, "traj": traj,
            "drafter": copy_model(root / "ck" / "drafter-base", short / "drafter", max_position_embeddings=16),
            "ar_drafter": copy_model(root / "ck" / "ar-drafter", short / "ar", max_position_embeddings=16)}


def toy_args(toy: dict[str, Path], tmp_path: Path) -> list[str]:
    from conftest import TOY_TRAJECTORIES

    ck = toy["root"] / "ck"
    return [f"verifier.path={ck / 'verifier'}", f"drafter.path={ck / 'drafter-base'}",
            f"ar_drafter.path={ck / 'ar-drafter'}", f"trajectories.out={toy['traj']}", *TOY_TRAJECTORIES,
            f"data.dir={toy['root'] / 'data'}", f"train.out={tmp_path / 'train'}", f"gkd.out={tmp_path / 'gkd'}",
            "train.gamma=4", "train.final_eval_prompts=0"]


def test_training_windows_past_the_drafters_context_are_refused(toy, tmp_path):
    from align.recipe_files import load_recipe
    from align.stages.train import check_data

    recipe = load_recipe("recipes/tiny/align.yaml", [*toy_args(toy, tmp_path), f"drafter.path={toy['drafter']}"])
    with pytest.raises(RecipeError, match=r"^train.gamma: row 0 of .* reads \d+ tokens; with train.gamma=4 it exceeds "
                                          r"the context of .*drafter \(16 tokens, drafter.path\)"):
        check_data(recipe)
    check_data(load_recipe("recipes/tiny/align.yaml", toy_args(toy, tmp_path)))  # the toy drafter's own context


def test_offline_kd_losses_need_stored_top_k_unless_a_dflash_step_runs_the_verifier(toy, tmp_path, monkeypatch):
    """Offline, a KD loss reads the verifier's distributions from the trajectories' stored top-k; a DFlash step runs
    the verifier (or reads its cached final states) anyway, so it needs none."""
    import align.stages.train as train_stage
    from align.recipe_files import load_recipe

    args = [*toy_args(toy, tmp_path), "train.losses={ce_streak: 1.0, fkl: 1.0}"]
    rows = train_stage.load_checked_trajectories(load_recipe("recipes/tiny/align.yaml", args))
    monkeypatch.setattr(train_stage, "load_checked_trajectories",
                        lambda recipe: rows.remove_columns(["topk_ids", "topk_logprobs"]))
    with pytest.raises(RecipeError, match=r"^train.losses: KD losses need verifier distributions"):
        train_stage.check_data(load_recipe("recipes/tiny/align.yaml", args))
    train_stage.check_data(load_recipe("recipes/tiny/dflash.yaml", [*args, "train.cache_verifier_states=true"]))


@pytest.mark.parametrize("override, expected", [
    # align train refuses these trajectories; gkd once trained on them
    ("trajectories.temperature=0.9", "trajectories.temperature: the trajectories in "),
    ("trajectories.max_new_tokens=20", "trajectories.max_new_tokens: the trajectories in "),
    ("ar_drafter.path={short} gkd.max_new_tokens=2", "trajectories.max_new_tokens: row "),
])
def test_gkd_checks_the_trajectories_as_train_does_before_loading_models(capsys, monkeypatch, toy, tmp_path, override,
                                                                         expected):
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("a model was loaded before the refusal"))
    assert run("gkd", "recipes/tiny/align.yaml", *toy_args(toy, tmp_path),
               *override.format(short=toy["ar_drafter"]).split()) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"align gkd: error: {expected}") and err.count("\n") == 1, err
    assert not (tmp_path / "gkd").exists()


# --------------------------------------------------------------------------------------------------------------------
# 10. the Python API's arguments: the stages' rules, RecipeErrors (issue 24: findings 7, 10)
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_api_token_ids_and_seeds_are_checked_as_the_recipe_checks_them():
    import numpy as np
    import torch

    import align

    pair = align.load(verifier=str(VERIFIER))
    expected = pair.generate("def f():", method="ar", max_new_tokens=4, eos_token_id=[5])[0].token_ids
    for eos in (torch.tensor(5), torch.tensor([5]), np.int64(5), [np.int32(5)]):  # a 0-d tensor raised TypeError
        assert pair.generate("def f():", method="ar", max_new_tokens=4, eos_token_id=eos)[0].token_ids == expected
    for eos in (torch.tensor(5.0), torch.tensor(True), [1.5], "</s>"):
        with pytest.raises(RecipeError, match=r"^eos_token_id: a token id or a list of them"):
            pair.generate("def f():", method="ar", eos_token_id=eos)
    with pytest.raises(RecipeError, match=r"^decode\.seed: a seed is an integer in \[0, 4294967295\]"):
        pair.generate("def f():", method="ar", seed=2**70)  # an OverflowError in torch's generator before


def test_api_conversations_follow_the_stages_rule(tmp_path):
    import align
    from test_chat_data import with_template

    chat = align.load(verifier=str(with_template(VERIFIER, tmp_path / "verifier")))
    question = [{"role": "user", "content": "def add(a, b):"}]
    answered = [*question, {"role": "assistant", "content": "    return a + b"}]
    # A chat dataset's row ends with its answer: the stages cut it, leaving the turn the model answers; so does the API.
    asked, cut = chat.generate([question, answered], method="ar", max_new_tokens=2)
    assert cut.prompt_token_ids == asked.prompt_token_ids
    with pytest.raises(RecipeError, match=r"^prompt 0: the conversation holds only assistant turns, so no prompt$"):
        chat.generate([answered[1:]], method="ar")


@pytest.mark.parametrize("argv, why", [
    # deepspeed ran these on the local machine without a word: 0 processes became the default, a missing hostfile
    # "local resources only"
    (["--num_gpus", "0"], "argument --num_gpus: an integer >= 1 is expected, got '0'"),
    (["--num_nodes", "-1"], "argument --num_nodes: an integer >= 1 is expected, got '-1'"),
    (["--master_port", "70000"], "argument --master_port: an integer in [1, 65535] is expected, got '70000'"),
    (["--hostfile", "/nonexistent/hostfile"], "argument --hostfile: no such file: /nonexistent/hostfile"),
])
@pytest.mark.parametrize("stage", ["train", "trajectories"])
def test_launcher_options_out_of_range_are_refused(capsys, started, stage, argv, why):
    line = refused(capsys, started, stage, "recipes/tiny/align.yaml", *argv)
    assert why in line, line
