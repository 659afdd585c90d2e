"""A probe of what align promises on bad input and faults (DESIGN §9, issue 24), as a new user and an operator meet
them: a table of cases against every CLI command and the Python API, each classified by what happened.

    python tests/probe.py                  # every case (~10 min on 2 cores: builds a toy family first)
    python tests/probe.py --ci             # the fast subset tests/test_probe.py runs
    python tests/probe.py --finding 7,10   # the cases of these findings of issue 24 ("-": the older guarantees)
    python tests/probe.py -k seed          # the cases whose name holds "seed"

Classes:
- clean: refused with one line on stderr and exit 2, no model built, nothing written, nothing changed;
- handled: a fault handled as promised (resume exact, one line naming the path, every process stopped, ...);
- data-loss: a file that existed before the case changed or vanished (the sandbox is hashed before and after);
- silent: exit 0, or a wrong result, where a refusal (or another result) was due;
- traceback: a Python traceback on stderr, or a raw exception out of the API;
- late: refused, but only after a model was built (transformers' PreTrainedModel.__init__ is watched) or after
  something was written;
- other: anything else (a refusal in several lines, another exit code, a refusal for another reason than the case's).

Cases run in-process through `align.cli.main` (fast), or, where they train or start processes, as a child process
running the same entry point (`--child`). After each case the sandbox is put back as it was built.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fnmatch
import hashlib
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
for _path in (str(TESTS), str(ROOT)):  # this checkout's align first, then tests/ (conftest's toy settings)
    if _path not in sys.path:
        sys.path.insert(0, _path)

from conftest import TOY, TOY_TRAJECTORIES  # noqa: E402  (also sets HF_HUB_OFFLINE: nothing reaches the network)

CLASSES = ("clean", "handled", "data-loss", "silent", "traceback", "late", "other")
BUILT: list[str] = []  # classes of the models built since the last reset (watch_models)


# --------------------------------------------------------------------------------------------------------------------
# watching and breaking
# --------------------------------------------------------------------------------------------------------------------
def watch_models() -> Callable[[], None]:
    """Record every transformers model built (from_pretrained and from_config both run PreTrainedModel.__init__);
    returns what undoes it."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.__init__
    if getattr(original, "probe", False):
        return lambda: None

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        BUILT.append(type(self).__name__)
        original(self, *args, **kwargs)

    init.probe = True  # type: ignore[attr-defined]
    PreTrainedModel.__init__ = init  # type: ignore[method-assign]

    def undo() -> None:
        PreTrainedModel.__init__ = original  # type: ignore[method-assign]
    return undo


def disk_full(*args: Any, **kwargs: Any) -> Any:
    """What a write on a full disk raises, naming the first path it was given."""
    path = next((os.fspath(a) for a in args if isinstance(a, (str, os.PathLike))), "?")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


@contextlib.contextmanager
def faults(spec: str) -> Iterator[None]:
    """`module:attr,...`: each replaced by disk_full for the duration (what a full disk does at that write)."""
    undo = []
    for item in filter(None, spec.split(",")):
        module_name, attr = item.split(":")
        module = importlib.import_module(module_name)
        undo.append((module, attr, getattr(module, attr)))
        setattr(module, attr, disk_full)
    try:
        yield
    finally:
        for module, attr, value in reversed(undo):
            setattr(module, attr, value)


def child(marker: str, argv: list[str]) -> int:
    """`probe.py --child MARKER -- <align args>`: align's CLI with the model watch and the faults of
    $ALIGN_PROBE_FAULTS, writing the models built to MARKER at exit."""
    watch_models()
    code = 1
    try:
        with faults(os.environ.get("ALIGN_PROBE_FAULTS", "")):
            from align.cli import main

            code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001  (what reaches the user as a traceback)
        traceback.print_exc()
        code = 1
    finally:
        Path(marker).write_text(json.dumps({"built": BUILT}))
    return code


# --------------------------------------------------------------------------------------------------------------------
# the sandbox: a toy family and what stages wrote from it, hashed before and after each case
# --------------------------------------------------------------------------------------------------------------------
_DIGESTS: dict[tuple[str, int, int, int], str] = {}  # (path, inode, size, mtime_ns) -> sha256: unchanged files


def tree(root: Path) -> dict[str, str]:
    """Every path under root -> 'dir', 'link:<target>' or its sha256 (a file whose inode, size and modification time
    are those already hashed is not read again: any write changes its modification time)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                found[rel] = "link:" + os.readlink(path)
            elif path.is_dir():
                found[rel] = "dir"
            elif path.is_file():
                stat = path.stat()
                key = (str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
                if key not in _DIGESTS:
                    digest = hashlib.sha256()
                    with path.open("rb") as f:
                        for block in iter(lambda: f.read(1 << 20), b""):
                            digest.update(block)
                    _DIGESTS[key] = digest.hexdigest()
                found[rel] = _DIGESTS[key]
    return found


@dataclass
class Sandbox:
    root: Path  # S: what cases read and write
    pristine: Path  # a copy of S as built, to put it back after each case
    recipe: Path  # the base recipe: every path in S
    has: set[str] = field(default_factory=set)  # optional parts built: "run" (a finished 3-step training run)
    built_tree: dict[str, str] = field(default_factory=dict)
    pair: Any = None  # the Python API's Pair on the toy family, loaded once
    chat_pair: Any = None  # the same with a chat template
    dflash_pair: Any = None

    def restore(self) -> None:
        """Put S back as it was built: remove what is new, copy back what changed or vanished."""
        now = tree(self.root)
        for folder, dirs, files in os.walk(self.root):  # a case may have taken a permission away
            for name in dirs:
                os.chmod(Path(folder) / name, 0o755)
        for rel in sorted((r for r in now if r not in self.built_tree), key=len, reverse=True):
            path = self.root / rel
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
        for rel, digest in sorted(self.built_tree.items()):
            if now.get(rel) == digest:
                continue
            target, source = self.root / rel, self.pristine / rel
            if target.is_symlink() or target.is_file():
                target.unlink()
            elif target.is_dir() and digest != "dir":
                shutil.rmtree(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            if digest == "dir":
                target.mkdir(exist_ok=True)
            elif digest.startswith("link:"):
                target.symlink_to(digest[5:])
            else:
                shutil.copy2(source, target)


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return path


def linked_model(source: Path, dest: Path, weights: Optional[bytes] = None, **config: Any) -> Path:
    """A copy of a model folder (weights linked unless `weights` replaces them), its config.json updated."""
    dest.mkdir(parents=True)
    for f in source.iterdir():
        if f.name == "model.safetensors" and weights is None:
            (dest / f.name).symlink_to(f)
        elif f.name == "model.safetensors":
            (dest / f.name).write_bytes(weights)
        elif f.is_file():
            shutil.copy2(f, dest / f.name)
    if config:
        data = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps({**data, **config}))
    return dest


def base_recipe(S: Path) -> str:
    ck = S / "ck"
    return f"""# the probe's base recipe: the toy family in {S}
name: probe
verifier: {{path: {ck / 'verifier'}, device: cpu}}
drafter: {{path: {ck / 'drafter-base'}, device: cpu}}
ar_drafter: {{path: {ck / 'ar-drafter'}, device: cpu}}
data: {{dir: {S / 'data'}}}
trajectories: {{out: {S / 'traj'}, completions_per_prompt: 2, temperature: 0.5, max_new_tokens: 12, store_topk: 8,
               num_prompts: 24, batch_size: 8}}
train: {{out: {S / 'run'}, gamma: 4, windows_per_sequence: 2, max_steps: 3, micro_batch_size: 2, lr: 3.0e-3,
        warmup_steps: 0, save_every: 1, eval_every: 100, final_eval_prompts: 1, bf16: false, report_to: none}}
gkd: {{out: {S / 'gkd'}, max_steps: 1, batch_size: 2, max_new_tokens: 4, report_to: none}}
decode: {{gamma: 4, max_new_tokens: 8}}
calibrate: {{out: {S / 'spiffy'}, num_prompts: 3, block_length: 8, budget: 3}}
eval: {{out: {S / 'evalrun'}, num_prompts: 2, methods: [specdiff], sampling_temperature: 0, warmup: 0,
       spiffy_budgets: [1, 2]}}
export: {{out: {S / 'export'}, license: apache-2.0}}
serve_check: {{out: {S / 'serve'}, drafter: {S / 'dflash' / 'step_1'}}}
"""


def in_process(argv: list[str]) -> int:
    from align.cli import main

    try:
        return main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def child_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def run_child(argv: list[str], env: Optional[dict[str, str]] = None, timeout: float = 600) -> tuple[int, str, str,
                                                                                                     list[str]]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as marker:
        pass
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", marker.name, "--", *argv],
                              capture_output=True, text=True, timeout=timeout, env=env or child_env(), cwd=os.getcwd())
        built = json.loads(Path(marker.name).read_text() or "{}").get("built", [])
        return done.returncode, done.stdout, done.stderr, built
    finally:
        os.unlink(marker.name)


def build(root: Path, family: Optional[Path] = None, full: bool = True) -> Sandbox:
    """The sandbox: the toy family (bootstrapped here, or copied from `family`, a root as tests/conftest.py's
    toy_family makes it), trajectories, broken model folders, a DFlash drafter, a draft graph, an eval.json, user
    files in the working folder, and (`full`) a finished 3-step training run."""
    S = root / "sandbox"
    S.mkdir(parents=True)
    recipe = write(S / "recipes" / "base.yaml", base_recipe(S))
    with captured():
        if family is None:
            assert in_process(["bootstrap", str(ROOT / "recipes/tiny/bootstrap.yaml"), f"bootstrap.out={S / 'ck'}",
                               f"data.dir={S / 'data'}", *TOY]) == 0, "the toy family did not build"
        else:
            shutil.copytree(family / "ck", S / "ck", symlinks=True)
            shutil.copytree(family / "data", S / "data", symlinks=True)
        # made here, whatever the family: a manifest names the verifier it was made with
        assert in_process(["trajectories", str(recipe)]) == 0, "the toy trajectories did not build"
    ck = S / "ck"
    models = S / "models"
    weights = (ck / "drafter-base" / "model.safetensors").read_bytes()
    linked_model(ck / "drafter-base", models / "truncated", weights[: len(weights) // 2])
    linked_model(ck / "drafter-base", models / "small_vocab", vocab_size=4096)
    linked_model(ck / "drafter-base", models / "short_context", max_position_embeddings=16)
    linked_model(ck / "ar-drafter", models / "short_context_ar", max_position_embeddings=16)
    linked_model(ck / "drafter-base", models / "bad_spec", drafter_spec={"mask_token_id": 2, "logits_shift": 2,
                                                                         "attention": "block_causal"})
    linked_model(ck / "drafter-base", models / "other_drafter")  # the same weights at another path
    bad_config = linked_model(ck / "verifier", models / "bad_config")
    (bad_config / "config.json").write_text('{"model_type": "llama", ')
    (models / "no_config").mkdir()
    nan_weights(ck / "drafter-base", models / "nan_drafter")
    layers = json.loads((ck / "verifier" / "config.json").read_text())["num_hidden_layers"]
    linked_model(ck / "verifier", models / "one_layer_more", num_hidden_layers=layers + 1)  # config.json edited
    linked_model(ck / "verifier", models / "one_layer_less", num_hidden_layers=layers - 1)
    from test_chat_data import with_template

    with_template(ck / "verifier", models / "chat_verifier")  # what align prompts samples from (Magpie)
    with captured():
        dflash_drafter(ck / "verifier", S / "dflash" / "step_1")
        speculators_folders(ck / "verifier", S / "spec")
    from align.draft_graph import DraftGraph

    DraftGraph((frozenset({(1, 1)}), frozenset({(1, 1), (2, 1)}), frozenset({(1, 2)})), block_length=8).save(
        S / "spiffy" / "draft_graph.json")
    write(S / "evalrun" / "eval.json", json.dumps({"schema_version": 2, "methods": {
        name: {"tau": tau, "speedup": speed, "exact_match": 1.0} for name, tau, speed in
        (("ar", 1.0, 1.0), ("hf_generate", 1.0, 0.9), ("specdiff", 2.0, 1.3))}, "meta": {"num_prompts": 2}}))
    write(S / "work" / "notes.txt", "a user's notes in the working folder\n")
    sandbox = Sandbox(S, root / "pristine", recipe)
    if full:
        code, out, err, _ = run_child(["train", str(recipe)])
        assert code == 0, f"the toy training run did not finish:\n{err[-3000:]}"
        write(S / "run" / "notes.txt", "the operator's notes on this run\n")
        sandbox.has.add("run")
    shutil.copytree(S, sandbox.pristine, symlinks=True)
    sandbox.built_tree = tree(S)
    return sandbox


def nan_weights(source: Path, dest: Path) -> None:
    """A copy of a drafter whose weights hold a NaN (what a diverged run that escaped the guard would leave)."""
    from safetensors.torch import load_file, save_file

    linked_model(source, dest, weights=b"")
    tensors = load_file(str(source / "model.safetensors"))
    name = next(iter(tensors))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "sha256.json").unlink(missing_ok=True)  # the documented route for a deliberate edit: its values are wrong


def dflash_drafter(verifier: Path, folder: Path) -> None:
    import torch

    from align.checkpoint import save_merged
    from align.config import DFlashSection, VerifierSection
    from align.models import load_tokenizer
    from align.drafters.loading import new_dflash_drafter

    section = VerifierSection(path=str(verifier), device="cpu", dtype="float32")
    tokenizer = load_tokenizer(str(verifier))
    torch.manual_seed(0)
    drafter, _ = new_dflash_drafter(section, DFlashSection(intermediate_size=64), section, tokenizer.mask_token_id, 4)
    save_merged(drafter, tokenizer, folder, {})


def speculators_folders(verifier: Path, root: Path) -> None:
    """root/full and root/pruned (a 64-token draft vocabulary): a DFlash drafter on the sandbox's verifier written as
    speculators saves one (no copy of the verifier's embeddings), with the verifier's tokenizer as align export
    writes it: the folders issue 52's cases edit key by key."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from align.drafters.dflash import DFlashDrafter, config_for_verifier
    from align.drafters.speculators_format import speculators_config
    from align.models import load_tokenizer

    tokenizer = load_tokenizer(str(verifier))
    verifier_config = AutoConfig.from_pretrained(verifier)
    for name, vocab in (("full", None), ("pruned", 64)):
        torch.manual_seed(0)
        config = config_for_verifier(verifier_config, tokenizer.mask_token_id, intermediate_size=64, block_size=5,
                                     draft_vocab_size=vocab)
        drafter = DFlashDrafter(config)
        if vocab is not None:
            ids = torch.arange(10, 10 + 2 * vocab, 2)  # ascending verifier ids, speculators' order
            drafter.d2t.copy_(ids - torch.arange(vocab))
            drafter.t2d[ids] = True
        folder = root / name
        folder.mkdir(parents=True)
        write(folder / "config.json", json.dumps(speculators_config(config, str(verifier), ["LlamaForCausalLM"],
                                                                    torch.float32), indent=2))
        save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        tokenizer.save_pretrained(folder)


@contextlib.contextmanager
def captured() -> Iterator[dict[str, str]]:
    """stdout and stderr at the file-descriptor level (logging handlers, tqdm and warnings included)."""
    box: dict[str, str] = {}
    sys.stdout.flush()
    sys.stderr.flush()
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    saved = [os.dup(1), os.dup(2)]
    os.dup2(files[0].fileno(), 1)
    os.dup2(files[1].fileno(), 2)
    try:
        yield box
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        for name, f in zip(("out", "err"), files):
            f.seek(0)
            box[name] = f.read().decode(errors="replace")
            f.close()


# --------------------------------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class Result:
    code: Optional[int]  # exit status (None: an API call)
    out: str
    err: str
    built: list[str]
    error: Optional[BaseException] = None  # what an API call raised
    value: Any = None  # what it returned
    seconds: float = 0.0


@dataclass
class Case:
    name: str
    finding: str  # issue 24's finding number, or "-" for the guarantees that held before it
    argv: Optional[list[str]] = None  # `align` arguments; {S}: the sandbox, {R}: the base recipe
    api: Optional[Callable[[Sandbox], Any]] = None  # a Python API call
    kind: str = "refuse"  # refuse: clean is due; fault: `check` says
    expect: Optional[str] = None  # a refusal must hold this text (what it names)
    setup: Optional[Callable[[Sandbox], None]] = None  # writes the case's bad files (under S/bad)
    check: Optional[Callable[[Sandbox, Result], tuple[str, str]]] = None  # fault: (class, detail)
    run: Optional[Callable[[Sandbox], Result]] = None  # a case that drives processes itself
    env: dict[str, str] = field(default_factory=dict)
    faults: str = ""  # module:attr,... raising ENOSPC
    sub: bool = False  # in a child process (it trains, or may)
    needs: tuple[str, ...] = ()  # optional sandbox parts
    may_change: tuple[str, ...] = ()  # globs (relative to S) a handled fault may rewrite
    writes_ok: tuple[str, ...] = ()  # globs (relative to S) the case itself writes (not the refused command)
    ci: bool = False


def fill(text: str, sandbox: Sandbox) -> str:
    return text.replace("{S}", str(sandbox.root)).replace("{R}", str(sandbox.recipe))


def execute(case: Case, sandbox: Sandbox) -> Result:
    """Run one case in the sandbox's working folder; never raises."""
    cwd, env = os.getcwd(), dict(os.environ)
    os.chdir(sandbox.root / "work")
    os.environ.update({k: fill(v, sandbox) for k, v in case.env.items()})
    t0 = time.perf_counter()
    try:
        if case.run is not None:
            result = case.run(sandbox)
        elif case.argv is not None and case.sub:
            code, out, err, built = run_child([fill(a, sandbox) for a in case.argv],
                                              child_env(ALIGN_PROBE_FAULTS=case.faults))
            result = Result(code, out, err, built)
        elif case.argv is not None:
            del BUILT[:]
            with captured() as box, faults(case.faults):
                try:
                    code = in_process([fill(a, sandbox) for a in case.argv])
                except BaseException:  # noqa: BLE001
                    traceback.print_exc()
                    code = 1
            result = Result(code, box["out"], box["err"], list(BUILT))
        else:
            del BUILT[:]
            error, value = None, None
            with captured() as box:
                try:
                    value = case.api(sandbox)
                except Exception as e:  # noqa: BLE001  (classified below)
                    error = e
            result = Result(None, box["out"], box["err"], list(BUILT), error, value)
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
    result.seconds = time.perf_counter() - t0
    return result


def first_lines(text: str, n: int = 1) -> str:
    """The last `n` lines of `text`; of a traceback, the exception's line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if "Traceback (most recent call last)" in text:
        raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b", line)]
        lines = raised or lines
    return " | ".join(lines[-n:])[:150] if lines else ""


def classify(case: Case, sandbox: Sandbox, result: Result, lost: list[str], new: list[str]) -> tuple[str, str]:
    lines = [line for line in result.err.splitlines() if line.strip()]
    if lost:
        return "data-loss", f"changed or removed: {', '.join(lost[:4])}{' ...' if len(lost) > 4 else ''}"
    if "Traceback (most recent call last)" in result.err:
        return "traceback", first_lines(result.err)
    if case.api is not None and result.error is not None:
        from align.config import RecipeError

        if not isinstance(result.error, RecipeError):
            return "traceback", f"{type(result.error).__name__}: {str(result.error)[:120]}"
    if case.kind == "fault":
        return case.check(sandbox, result)
    if case.api is not None:
        if result.error is None:
            return "silent", f"returned {str(result.value)[:100]}"
        message = str(result.error)
        if "\n" in message:
            return "other", f"a RecipeError of {message.count(chr(10)) + 1} lines"
        if result.built:
            return "late", f"after building {', '.join(result.built)}: {message[:100]}"
        if case.expect and case.expect not in message:
            return "other", f"refused for another reason: {message[:120]}"
        return "clean", message[:150]
    if result.code == 0:
        return "silent", "exit 0: " + (first_lines(result.out) or "no output")
    if result.code != 2:
        return "other", f"exit {result.code}: {first_lines(result.err) or first_lines(result.out)}"
    if result.built or new:
        what = f"built {', '.join(dict.fromkeys(result.built))}" if result.built else f"wrote {', '.join(new[:3])}"
        return "late", f"{what} before: {first_lines(result.err)}"
    if len(lines) != 1:
        return "other", f"{len(lines)} lines on stderr: {first_lines(result.err, 2)}"
    if case.expect and case.expect not in lines[0]:
        return "other", f"refused for another reason: {lines[0][:130]}"
    return "clean", lines[0][:150]


def probe(case: Case, sandbox: Sandbox) -> tuple[str, str, float]:
    """(class, detail, seconds) of one case; the sandbox is put back afterwards."""
    try:
        if case.setup is not None:
            case.setup(sandbox)
        before = tree(sandbox.root)
        result = execute(case, sandbox)
        after = tree(sandbox.root)
        lost = [rel for rel, digest in before.items() if digest != "dir" and after.get(rel) != digest
                and not any(fnmatch.fnmatch(rel, pattern) for pattern in case.may_change)]
        new = [rel for rel in after if rel not in before
               and not any(fnmatch.fnmatch(rel, pattern) for pattern in case.writes_ok)]
        kind, detail = classify(case, sandbox, result, lost, new)
        return kind, detail, result.seconds
    except Exception as e:  # noqa: BLE001  (a bug of the probe's own: shown, not hidden)
        return "other", f"probe error: {type(e).__name__}: {e}"[:150], 0.0
    finally:
        sandbox.restore()


# --------------------------------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------------------------------
def bad(name: str, content: str | bytes) -> Callable[[Sandbox], None]:
    """A setup writing S/bad/<name>."""
    return lambda s: write(s.root / "bad" / name, content.replace("{S}", str(s.root)) if isinstance(content, str)
                           else content)


def refuse(name: str, finding: str, argv: list[str], expect: Optional[str] = None, **kw: Any) -> Case:
    return Case(name, finding, argv=argv, expect=expect, **kw)


LONG_PROMPT = '{"prompt": "' + "def f(): return 1\\n" * 400 + '"}\n'


def refused_on_loading(expect: str) -> Callable[[Sandbox, Result], tuple[str, str]]:
    """A fault check: exit 2, one line holding `expect`, no output folder written (a model may have been built: what
    is refused is only known from the weights)."""
    def check(s: Sandbox, result: Result) -> tuple[str, str]:
        # transformers' "Loading weights" bar is the loading this refusal comes from: not a line said
        lines = [line for line in re.split(r"[\r\n]", result.err)
                 if line.strip() and not re.search(r"\d+/\d+ \[[\d:<?]+", line)]
        if result.code != 2 or len(lines) != 1 or expect not in lines[0]:
            return "other", f"exit {result.code}: {first_lines(result.err, 2)}"
        if (s.root / "out" / "x").exists():
            return "late", f"wrote out/x before: {lines[0][:100]}"
        return "handled", lines[0][:150]
    return check


def with_base(extra: str) -> Callable[[Sandbox], None]:
    """S/bad/recipe.yaml: the base recipe with `extra` appended."""
    return lambda s: write(s.root / "bad" / "recipe.yaml", s.recipe.read_text() + extra)


def copy_traj(edit: Callable[[Path], None]) -> Callable[[Sandbox], None]:
    """S/bad/traj: a copy of the trajectories, edited."""
    def setup(s: Sandbox) -> None:
        shutil.copytree(s.root / "traj", s.root / "bad" / "traj")
        edit(s.root / "bad" / "traj")
    return setup


def flip_a_byte(path: Path, at: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def first_chunk_file(traj: Path) -> Path:
    return sorted((traj / "chunks").glob("*/*.arrow"))[0]


def exact_eval(**methods: Any) -> str:
    return json.dumps({"methods": methods})


def schema_cases() -> list[Case]:
    """Impossible values of each recipe section, through `align validate` (the loader every stage uses)."""
    values = [
        ("decode.gamma=0", "decode.gamma"), ("decode.temperature=-1", "decode.temperature"),
        ("decode.top_p=0", "decode.top_p"), ("decode.top_p=1.5", "decode.top_p"), ("decode.top_k=-1", "decode.top_k"),
        ("decode.adl_min_len=20", "decode"), ("decode.num_candidates=0", "decode.num_candidates"),
        ("decode.cps_threshold=0", "decode.cps_threshold"), ("decode.tree_nodes=0", "decode.tree_nodes"),
        ("decode.draft_choice=best", "decode.draft_choice"),
        ("train.lr=0", "train.lr"), ("train.lr=1e6", "train.lr"), ("train.losses={}", "train.losses"),
        ("train.losses={nope: 1}", "train.losses"), ("train.losses={streak: 0}", "train.losses.streak"),
        ("train.max_steps=0", "train.max_steps"), ("train.gamma=0", "train.gamma"),
        ("train.report_to=[all, wandb]", "train.report_to"), ("train.project=a/b", "train.project"),
        ("train.zero_stage=4", "train.zero_stage"), ("train.data_mode=replay", "train.data_mode"),
        ("gkd.lmbda=2", "gkd.lmbda"), ("gkd.beta=-0.1", "gkd.beta"), ("gkd.lr=5", "gkd.lr"),
        ("trajectories.temperature=0", "trajectories"), ("trajectories.top_p=0", "trajectories.top_p"),
        ("trajectories.batch_size=0", "trajectories.batch_size"), ("trajectories.backend=tgi", "trajectories.backend"),
        ("eval.methods=[nope]", "eval.methods[0]"), ("eval.mode=fast", "eval.mode"), ("eval.repeats=0", "eval.repeats"),
        ("eval.compare_drafters={'a b': x}", "eval.compare_drafters"),
        ("export.push_to_hub=not-an-id", "export.push_to_hub"), ("export.license=nope", "export"),
        ("export.license=other", "export"), ("export.format=gguf", "export.format"),
        ("data.chat_template=maybe", "data.chat_template"), ("verifier.dtype=fp8", "verifier.dtype"),
        ("verifier.device=tpu", "verifier.device"), ("drafter.logits_shift=2", "drafter.logits_shift"),
        ("drafter.mask_token_id=-1", "drafter.mask_token_id"), ("dflash.num_layers=0", "dflash.num_layers"),
        ("calibrate.budget=0", "calibrate.budget"), ("calibrate.threshold=0", "calibrate.threshold"),
        ("calibrate.position_order=random", "calibrate.position_order"),
        ("serve_check.max_acceptance_gap=0", "serve_check.max_acceptance_gap"),
        ("bootstrap.verifier.seq_len=4096", "bootstrap.verifier"), ("bootstrap.vocab_size=abc", "bootstrap.vocab_size"),
    ]
    cases = [refuse(f"validate {o}", "-", ["validate", "{R}", o], key, ci=True) for o, key in values]
    seeds = [("train.seed=-1", "train.seed"), ("train.seed=18446744073709551616", "train.seed"),
             ("decode.seed=-1", "decode.seed"), ("decode.seed=1180591620717411303424", "decode.seed"),
             ("gkd.seed=-5", "gkd.seed"), ("bootstrap.seed=-1", "bootstrap.seed")]
    cases += [refuse(f"validate {o}", "10", ["validate", "{R}", o], f"{key}: a seed is", ci=True) for o, key in seeds]
    return cases


def cases() -> list[Case]:
    S = "{S}"
    table: list[Case] = []
    add = table.append

    # --- recipe files --------------------------------------------------------------------------------------------
    recipe_files = [
        ("missing recipe", None, "recipe not found"), ("empty recipe", "", "empty recipe"),
        ("comments only", "# nothing\n", "empty recipe"), ("a list", "- a\n- b\n", "a mapping of sections"),
        ("a scalar", "just text\n", "a mapping of sections"), ("not UTF-8", b"\xff\xfe\x00bad", "not UTF-8"),
        ("invalid YAML", "train:\n  lr: [1, 2\n", "invalid YAML"), ("a section as a value", "train: 5\n", "train"),
        ("an unknown section", "trian:\n  lr: 1.0e-3\n", "unknown key 'trian'"),
        ("an unknown key", "train:\n  lrr: 1.0e-3\n", "unknown key 'train.lrr'"),
        ("a wrong type", "train:\n  lr: fast\n", "train.lr"),
    ]
    for name, content, expect in recipe_files:
        add(refuse(f"recipe: {name}", "-", ["validate", f"{S}/bad/recipe.yaml"], expect,
                   setup=None if content is None else bad("recipe.yaml", content), ci=True))
    add(refuse("recipe: a folder", "-", ["validate", f"{S}/work"], "is a folder", ci=True))
    add(refuse("recipe: a second train: section", "7", ["validate", f"{S}/bad/recipe.yaml"], "key 'train' is given twice",
               setup=with_base("train:\n  max_steps: 5\n"), ci=True))
    add(refuse("recipe: a key repeated in a section", "7", ["validate", f"{S}/bad/recipe.yaml"],
               "key 'lr' is given twice", setup=bad("recipe.yaml", "train:\n  lr: 1.0e-3\n  lr: 1.0e-2\n"), ci=True))
    add(refuse("recipe: a repeated key in eval's recipe", "7", ["eval", f"{S}/bad/recipe.yaml"],
               "key 'decode' is given twice", setup=with_base("decode:\n  gamma: 2\n"), ci=True))
    add(refuse("override: a key repeated in a flow mapping", "7",
               ["validate", "{R}", "train.losses={streak: 1, streak: 2}"], "given twice", ci=True))
    for override, expect in [("gamma", "bad override"), ("=3", "bad override"), ("decode..gamma=3", "bad override"),
                             ("train.lr.x=1", "is a value, not a section"), ("data.test_prompts=x", "unknown key"),
                             ("decode.temperature=.inf", "finite"), ("train.lr=.nan", "train.lr")]:
        add(refuse(f"override {override}", "-", ["validate", "{R}", override], expect, ci=True))
    table += schema_cases()
    add(refuse("train train.seed=-1", "10", ["train", "{R}", f"train.out={S}/out/seed", "train.seed=-1"],
               "train.seed", sub=True))
    add(refuse("eval decode.seed=2**70", "10", ["eval", "{R}", f"eval.out={S}/out/eval", f"decode.seed={2**70}"],
               "decode.seed", ci=True))

    # --- usage ---------------------------------------------------------------------------------------------------
    for argv, expect in [([], "required"), (["evl", "{R}"], "invalid choice"), (["eval"], "required: recipe"),
                         (["eval", "{R}", "--bogus"], "unrecognized arguments"),
                         (["eval", "{R}", "--num_gpus", "2"], "unrecognized arguments: --num_gpus"),
                         (["train", "{R}", "--num_gpus", "zero"], "--num_gpus"),
                         (["validate", "{R}", "--get", "train.nope"], "unknown key 'train.nope'")]:
        add(refuse(f"usage: align {' '.join(argv)}".replace("{R}", "recipe"), "-", argv, expect, ci=True))
    add(refuse("launcher: --num_gpus 0", "-", ["train", "{R}", "--num_gpus", "0", f"train.out={S}/out/n0"],
               "--num_gpus", sub=True))
    add(refuse("launcher: --hostfile missing", "-", ["train", "{R}", "--hostfile", f"{S}/nohosts",
                                                     f"train.out={S}/out/h"], "hostfile", sub=True))
    # DeepSpeed's resource filters (issue 36), refused before the runner starts (its own refusals are tracebacks)
    for argv, expect in [(["--include", "localhost:0", "--exclude", "localhost:1"], "do not go together"),
                         (["--include", "localhost:0", "--num_gpus", "2"], "do not go together"),
                         (["--include", "localhost:0:1"], "is not host[:slot"),
                         (["--exclude", "localhost:7"], "localhost has slots 0..0"),
                         (["--include", "worker-9"], "worker-9 is not a host of this host")]:
        add(refuse(f"launcher: {' '.join(argv)}", "36", ["train", "{R}", *argv, f"train.out={S}/out/f"], expect,
                   env={"LOCAL_SIZE": "1"}, ci=True))
    # `align init` (issue 36): nothing written over, nothing written for a model it cannot read
    add(refuse("init: an existing recipe in --out", "36", ["init", f"{S}/ck/verifier", "--out", f"{S}/bad"],
               "never writes over a recipe", setup=bad("eval.yaml", "name: mine\n"), ci=True))
    add(refuse("init: a model folder that does not exist", "36", ["init", f"{S}/models/missing", "--out",
                                                                  f"{S}/out/init"], "cannot read its config", ci=True))
    add(refuse("init: --out is a file", "36", ["init", f"{S}/ck/verifier", "--out", f"{S}/bad/file"],
               "a file, not a folder", setup=bad("file", "x"), ci=True))
    # temperatures whose logits ÷ temperature overflow (issue 35)
    for override in ("eval.sampling_temperature=1e-300", "decode.temperature=1e-30", "decode.draft_temperature=1e-9",
                     "trajectories.temperature=1e-20"):
        add(refuse(f"override {override}", "35", ["validate", "{R}", override], "at least 1e-05", ci=True))

    # --- models --------------------------------------------------------------------------------------------------
    models = [
        ("train", "drafter.path", f"{S}/models/missing", "no such model folder"),
        ("train", "drafter.path", f"{S}/ck/verifier", "is the verifier"),
        ("train", "drafter.path", f"{S}/ck/ar-drafter", "is not a diffusion drafter"),
        ("train", "drafter.path", f"{S}/models/bad_spec", "drafter.path"),
        ("trajectories", "verifier.path", f"{S}/ck/drafter-base", "is a diffusion drafter"),
        ("eval", "drafter.path", f"{S}/models/truncated", "truncated or corrupt"),
        ("eval", "drafter.path", f"{S}/models/small_vocab", "vocabulary size 4096"),
        ("eval", "verifier.path", f"{S}/models/bad_config", "cannot read"),
        ("eval", "eval.compare_drafters", f"{{other: {S}/models/truncated}}", "eval.compare_drafters.other"),
        ("calibrate", "drafter.path", f"{S}/models/no_config", "has no config.json"),
        ("gkd", "ar_drafter.path", f"{S}/ck/drafter-base", "is a diffusion drafter"),
        ("export", "drafter.path", f"{S}/work/notes.txt", "is a file"),
        ("export", "drafter.path", "nobody/no-such-model", "Hub is offline"),
        ("serve-check", "verifier.path", f"{S}/models/missing", "no such model folder"),
    ]
    for stage, key, value, expect in models:
        add(refuse(f"{stage} {key}={value.replace(S, 'S')}", "-", [stage, "{R}", f"{key}={value}",
                   f"{stage.replace('-', '_')}.out={S}/out/x"], expect, ci=True))
    add(refuse("eval sd_ar with ar_drafter.path missing", "-", ["eval", "{R}", "eval.methods=[sd_ar]",
               f"ar_drafter.path={S}/models/missing", f"eval.out={S}/out/e"], "ar_drafter.path", ci=True))

    # --- outputs -------------------------------------------------------------------------------------------------
    for stage, key in [("bootstrap", "bootstrap.out"), ("trajectories", "trajectories.out"), ("train", "train.out"),
                       ("gkd", "gkd.out"), ("calibrate", "calibrate.out"), ("eval", "eval.out"),
                       ("export", "export.out"), ("serve-check", "serve_check.out")]:
        add(refuse(f"{stage} {key} is an existing file", "-", [stage, "{R}", f"{key}={S}/work/notes.txt"],
                   f"{key}: ", ci=True, env={"ALIGN_VLLM_PYTHON": sys.executable} if stage == "serve-check" else {}))
    add(refuse("eval.out under a file", "-", ["eval", "{R}", f"eval.out={S}/work/notes.txt/eval"], "is a file",
               ci=True))
    add(refuse("eval.out a dangling link", "-", ["eval", "{R}", f"eval.out={S}/bad/link"], "dangling",
               setup=lambda s: (s.root / "bad").mkdir() or (s.root / "bad" / "link").symlink_to(s.root / "gone"),
               ci=True))
    add(refuse("eval data.dir is a file", "-", ["eval", "{R}", f"data.dir={S}/work/notes.txt",
                                                f"eval.out={S}/out/e"], "data.dir", ci=True))

    # --- prompt sources ------------------------------------------------------------------------------------------
    prompts = [
        ("eval", "eval.prompts", "missing.jsonl", None, "no such file"),
        ("eval", "eval.prompts", "latin1.jsonl", b'{"prompt": "caf\xe9"}\n', "not UTF-8"),
        ("eval", "eval.prompts", "broken.jsonl", '{"prompt": "a"}\n{bad\n', "cannot read"),
        ("eval", "eval.prompts", "empty.jsonl", "", "holds no prompts"),
        ("eval", "eval.prompt_column", "text", None, None),
        ("trajectories", "data.train_prompts", "chats.jsonl",
         '{"prompt": [{"role": "user", "content": "hi"}]}\n', "need a chat template"),
        ("trajectories", "data.train_prompts", "answers.jsonl",
         '{"prompt": [{"role": "assistant", "content": "a"}]}\n', "only assistant turns"),
        ("trajectories", "data.train_prompts", "numbers.jsonl", '{"prompt": 3}\n', "neither a string"),
        ("calibrate", "calibrate.prompts", "missing.parquet", None, "no such file"),
    ]
    for stage, key, name, content, expect in prompts:
        value = f"{S}/bad/{name}" if key.endswith("prompts") else name
        extra = [f"eval.prompts={S}/bad/ok.jsonl"] if key == "eval.prompt_column" else []
        setup = bad(name, content) if content is not None else (
            bad("ok.jsonl", '{"prompt": "def f():"}\n') if extra else None)
        add(refuse(f"{stage} {key}: {name}", "-", [stage, "{R}", f"{key}={value}", *extra,
                                                   f"{stage}.out={S}/out/p"], expect or key, setup=setup, ci=True))
    # a mixture of training prompt sources (data.train_prompts as a list): every refusal names the entry
    ok_rows = bad("ok.jsonl", '{"prompt": "def f():"}\n' * 4)
    mixtures = [
        ("no num_prompts", f"[{{path: {S}/bad/ok.jsonl}}]", ["trajectories.num_prompts=null"],
         "trajectories.num_prompts: a mixture"),
        ("a source short of its share", f"[{{path: {S}/bad/ok.jsonl}}, {{path: {S}/bad/ok.jsonl, weight: 9}}]",
         ["trajectories.num_prompts=20"], "data.train_prompts[1]: "),
        ("a weight that draws nothing", f"[{{path: {S}/bad/ok.jsonl}}, {{path: {S}/bad/ok.jsonl, weight: 0.01}}]",
         ["trajectories.num_prompts=4"], "data.train_prompts[1].weight"),
        ("a missing source", f"[{{path: {S}/bad/ok.jsonl}}, {{path: {S}/bad/gone.jsonl}}]",
         ["trajectories.num_prompts=4"], "data.train_prompts[1]: no such file"),
        ("a revision of a local file", f"[{{path: {S}/bad/ok.jsonl, revision: v2}}]",
         ["trajectories.num_prompts=4"], "data.train_prompts[0].revision"),
        ("an unknown key in an entry", f"[{{path: {S}/bad/ok.jsonl, colum: text}}]", [],
         "data.train_prompts[0].colum"),
        ("a zero weight", f"[{{path: {S}/bad/ok.jsonl, weight: 0}}]", [], "data.train_prompts[0].weight"),
    ]
    for what, value, extra, expect in mixtures:
        add(refuse(f"trajectories: a prompt mixture with {what}", "-", [
            "trajectories", "{R}", f"data.train_prompts={value}", *extra, f"trajectories.out={S}/out/t"], expect,
            setup=ok_rows, ci=True))
    add(refuse("eval.prompt_field, the column key's old name", "-", ["eval", "{R}", "eval.prompt_field=question",
               f"eval.out={S}/out/e"], "is now 'eval.prompt_column'", ci=True))
    add(refuse("eval: a prompt past the verifier's context", "-", ["eval", "{R}", f"eval.prompts={S}/bad/long.jsonl",
               f"eval.out={S}/out/e"], "exceeds", setup=bad("long.jsonl", LONG_PROMPT), ci=True))
    add(refuse("trajectories: a prompt past the verifier's context", "7", ["trajectories", "{R}",
               f"data.train_prompts={S}/bad/long.jsonl", f"trajectories.out={S}/out/t"],
               "data.train_prompts: prompt 0 has", setup=bad("long.jsonl", LONG_PROMPT), ci=True))
    for stage, key in [("trajectories", "trajectories.max_new_tokens"), ("eval", "decode.max_new_tokens"),
                       ("calibrate", "decode.max_new_tokens"), ("gkd", "gkd.max_new_tokens")]:
        add(refuse(f"{stage} {key}=5000 leaves no room for a prompt", "7", [stage, "{R}", f"{key}=5000",
                   f"{stage}.out={S}/out/n"], f"{key}: ", ci=True))
    add(refuse("calibrate: every prompt too long", "11", ["calibrate", "{R}", f"calibrate.prompts={S}/bad/long.jsonl",
               f"calibrate.out={S}/out/c"], "calibrate.prompts", setup=bad("long.jsonl", LONG_PROMPT), ci=True))
    add(refuse("eval dllm: a prompt past the drafter's context", "11", [
        "eval", "{R}", "eval.mode=dllm", f"calibrate.graph={S}/spiffy/draft_graph.json",
        f"eval.prompts={S}/bad/long.jsonl", f"eval.out={S}/out/e"], "eval.prompts: prompt 0",
        setup=bad("long.jsonl", LONG_PROMPT), ci=True))

    # --- trajectories align train and gkd read -------------------------------------------------------------------
    for stage in ("train", "gkd"):
        add(refuse(f"{stage}: no trajectories", "-", [stage, "{R}", f"trajectories.out={S}/out/none",
                   f"{stage}.out={S}/out/r"], "trajectories.out", ci=True))
        add(refuse(f"{stage}: a manifest that is not JSON", "-", [stage, "{R}", f"trajectories.out={S}/bad/traj",
                   f"{stage}.out={S}/out/r"], "manifest.json",
                   setup=copy_traj(lambda t: (t / "manifest.json").write_text('{"settings": ')), ci=True))
        add(refuse(f"{stage}: a corrupted chunk", "-", [stage, "{R}", f"trajectories.out={S}/bad/traj",
                   f"{stage}.out={S}/out/r"], "corrupted", setup=copy_traj(lambda t: flip_a_byte(first_chunk_file(t))),
                   ci=True))
        for override in ("trajectories.temperature=0.9", "trajectories.max_new_tokens=20"):
            add(refuse(f"{stage}: trajectories made with other settings ({override})", "7" if stage == "gkd" else "-",
                       [stage, "{R}", override, f"{stage}.out={S}/out/r"], override.split("=")[0], ci=True))
    add(refuse("train: windows past the drafter's context", "7", ["train", "{R}", f"drafter.path={S}/models/"
               "short_context", f"train.out={S}/out/r"], "train.gamma: row", sub=True))
    add(refuse("gkd: trajectories past the AR drafter's context", "7", [
        "gkd", "{R}", f"ar_drafter.path={S}/models/short_context_ar", "gkd.max_new_tokens=2", f"gkd.out={S}/out/g"],
        "trajectories.max_new_tokens: row", ci=True))
    add(refuse("trajectories.out holding other settings", "-", ["trajectories", "{R}", "trajectories.temperature=0.9"],
               "other settings", ci=True))

    # --- eval.json, draft_graph.json, checkpoints ----------------------------------------------------------------
    evals = {"not JSON": "{nope", "a list": "[1, 2]", "no methods": '{"meta": {}}',
             "no tau": exact_eval(ar={"speedup": 1.0}), "a string tau": exact_eval(ar={"tau": "x", "speedup": 1})}
    for name, content in evals.items():
        add(refuse(f"export.eval {name}", "10", ["export", "{R}", f"export.eval={S}/bad/eval.json",
                   f"export.out={S}/out/x"], "export.eval", setup=bad("eval.json", content), ci=True))
    add(refuse("export.eval a folder", "10", ["export", "{R}", f"export.eval={S}/work", f"export.out={S}/out/x"],
               "export.eval", ci=True))
    graph = '{"version": 2, "nodes": "oops", "block_length": 8}'
    add(refuse("export calibrate.graph malformed", "10", ["export", "{R}", f"calibrate.graph={S}/bad/graph.json",
               f"export.out={S}/out/x"], "calibrate.graph", setup=bad("graph.json", graph), ci=True))
    add(refuse("eval dllm calibrate.graph malformed", "10", ["eval", "{R}", "eval.mode=dllm",
               f"calibrate.graph={S}/bad/graph.json", f"eval.out={S}/out/e"], "calibrate.graph",
               setup=bad("graph.json", graph), ci=True))
    add(refuse("eval dllm graph of another block length", "-", ["eval", "{R}", "eval.mode=dllm", "calibrate.block_length=16",
               f"calibrate.graph={S}/spiffy/draft_graph.json", f"eval.out={S}/out/e"], "block length", ci=True))
    add(refuse("eval dllm without a graph", "-", ["eval", "{R}", "eval.mode=dllm", f"eval.out={S}/out/e"],
               "calibrate.graph", ci=True))
    exacts = {"exact_match null": exact_eval(ar={"exact_match": None}), "exact_match missing": exact_eval(ar={}),
              "not JSON": "{", "methods a list": '{"methods": [1]}'}
    for name, content in exacts.items():
        add(refuse(f"exact: {name}", "10", ["exact", f"{S}/bad/eval.json"], "eval.json",
                   setup=bad("eval.json", content), ci=True))
    add(refuse("exact: a folder", "10", ["exact", f"{S}/work"], "folder", ci=True))
    add(refuse("exact: a missing file", "-", ["exact", f"{S}/bad/none.json"], "exact", ci=True))
    add(refuse("export speculators of a standalone drafter", "11", ["export", "{R}", "export.format=speculators",
               f"export.out={S}/out/x"], "export.format", ci=True))
    add(refuse("eval specdiff2_select with a DFlash drafter", "11", ["eval", "{R}", f"drafter.path={S}/dflash/step_1",
               "eval.methods=[specdiff2_select]", f"eval.out={S}/out/e"], "eval.methods", ci=True))
    add(refuse("export a checkpoint with an unreadable meta.json", "10", [
        "export", "{R}", f"drafter.path={S}/bad/step", f"export.out={S}/out/x"], "meta.json",
        setup=lambda s: (linked_model(s.root / "ck" / "drafter-base", s.root / "bad" / "step"),
                         write(s.root / "bad" / "step" / "meta.json", '{"step": ')), ci=True))
    add(refuse("export a checkpoint with flipped bits", "6", ["export", "{R}", f"drafter.path={S}/bad/step",
               f"export.out={S}/out/x"], "model.safetensors", setup=lambda s: (
                   shutil.copytree(s.root / "run" / "step_2", s.root / "bad" / "step"),
                   flip_a_byte(s.root / "bad" / "step" / "model.safetensors")), needs=("run",)))
    add(refuse("export NaN weights", "6", ["export", "{R}", f"drafter.path={S}/models/nan_drafter",
                                          f"export.out={S}/out/x"], "drafter.path"))
    # Known only once the weights are read into the model (their values; which tensors config.json's model has):
    # refused as the model loads, in one line, before any method runs and with nothing written. "handled", not
    # "clean", since a model was built first.
    add(Case("eval NaN drafter weights (before any method runs)", "35", argv=["eval", "{R}",
             f"drafter.path={S}/models/nan_drafter", f"eval.out={S}/out/x"], kind="fault",
             check=refused_on_loading("holds NaN or infinite"), ci=True))
    for edited in ("one_layer_more", "one_layer_less"):  # config.json is outside sha256.json: edited by hand
        add(Case(f"eval a verifier whose config.json names {edited.replace('_', ' ')}", "35",
                 argv=["eval", "{R}", f"verifier.path={S}/models/{edited}", "eval.methods=[ar]", f"eval.out={S}/out/x"],
                 kind="fault", check=refused_on_loading("config.json does not describe the weights"), ci=True))
    add(refuse("export a truncated checkpoint", "-", ["export", "{R}", f"drafter.path={S}/models/truncated",
                                                     f"export.out={S}/out/x"], "truncated", ci=True))

    # --- tools ---------------------------------------------------------------------------------------------------
    add(refuse("latest: no such folder", "-", ["latest", f"{S}/none"], "no step_", ci=True))
    add(refuse("latest: a file", "-", ["latest", f"{S}/work/notes.txt"], "no step_", ci=True))
    add(refuse("throughput: no run", "-", ["throughput", f"{S}/none"], "not a finished", ci=True))
    add(refuse("throughput --warmup-steps -1", "10", ["throughput", f"{S}/none", "--warmup-steps", "-1"],
               "--warmup-steps", ci=True))
    add(Case("throughput: a torn metrics.jsonl", "8", ["throughput", f"{S}/run"], kind="fault", check=torn_throughput,
             setup=lambda s: open(s.root / "run" / "metrics.jsonl", "a").write('{"step": 3, "lo'), needs=("run",)))
    model = f"{S}/ck/verifier"
    small = ["--context", "8", "--max-tokens", "4", "--rounds", "1", "--device", "cpu", "--dtype", "float32"]
    for extra, expect in [(["--context", "0"], "--context"), (["--max-tokens", "0"], "--max-tokens"),
                          (["--rounds", "0"], "--rounds"), (["--rounds", "abc"], "--rounds"),
                          (["--context", "2000"], "exceeds"), (["--out", f"{S}/work"], "--out"),
                          (["--out", f"{S}/work/notes.txt/costs.json"], "--out"), (["--device", "tpu0"], "--device"),
                          (["--dtype", "int8"], "--dtype")]:
        add(refuse(f"verify-costs {' '.join(extra).replace(S, 'S')}", "10" if expect in ("--context", "--max-tokens",
                   "--rounds", "--out", "exceeds") else "-", ["verify-costs", model, *small, *extra], expect, ci=True))
    add(refuse("verify-costs: an unknown model", "-", ["verify-costs", f"{S}/none", *small], "neither", ci=True))

    # --- environments --------------------------------------------------------------------------------------------
    add(refuse("trajectories vllm: ALIGN_VLLM_PYTHON without vllm", "10", [
        "trajectories", "{R}", "trajectories.backend=vllm", f"trajectories.out={S}/out/t"], "trajectories.backend",
        env={"ALIGN_VLLM_PYTHON": sys.executable}, ci=True))
    add(refuse("serve-check: ALIGN_VLLM_PYTHON without vllm", "10", ["serve-check", "{R}"], "serve_check",
               env={"ALIGN_VLLM_PYTHON": sys.executable}, ci=True))
    add(refuse("trajectories vllm: ALIGN_VLLM_PYTHON missing", "-", [
        "trajectories", "{R}", "trajectories.backend=vllm", f"trajectories.out={S}/out/t"], "vLLM's own environment",
        env={"ALIGN_VLLM_PYTHON": f"{S}/none/python"}, ci=True))
    add(refuse("serve-check: ALIGN_VLLM_PYTHON not a python", "10", ["serve-check", "{R}"], "serve_check",
               env={"ALIGN_VLLM_PYTHON": "/bin/false"}, ci=True))

    table += surface_cases()
    table += api_cases()
    table += operator_cases()
    table += foreign_cases()
    return table


# --------------------------------------------------------------------------------------------------------------------
# the Python API
# --------------------------------------------------------------------------------------------------------------------
def surface_cases() -> list[Case]:
    """Issue 35's surfaces: memory, convert, prompts, derive, DFlash training and serve-check, as their recipes and
    commands are misused (the Python API's are in api_cases)."""
    S = "{S}"
    table: list[Case] = []
    add = table.append

    # --- every key of these sections, impossible values (the loader every stage uses) ----------------------------
    values = [
        "memory.world_size=0", "memory.prompt_tokens=0", "memory.out=''", "memory.device=tpu", "memory.world_size=true",
        "convert.dtype=int8", "convert.gguf_file=''", "convert.license=''",
        "prompts.num_prompts=0", "prompts.max_samples=0", "prompts.batch_size=0", "prompts.backend=tgi",
        "prompts.vllm_cpu_kv_cache_gib=0", "prompts.system_prompts=[]", "prompts.temperature=0", "prompts.top_p=0",
        "prompts.top_p=1.5", "prompts.max_new_tokens=0", "prompts.min_words=0", "prompts.min_ascii=1.5",
        "prompts.min_distinct_words=-0.1", "prompts.near_duplicate=0", "prompts.seed=-1", "prompts.num_prompts=true",
        "prompts.temperature=.nan",
        "derive.drafter=gpt", "derive.layers=[]", "derive.layers=[-1]", "derive.num_layers=0",
        "derive.attention=bidirectional", "derive.logits_shift=2", "derive.mask_token_id=-1", "derive.max_steps=0",
        "derive.lr=0", "derive.min_lr_ratio=2", "derive.warmup_steps=-1", "derive.weight_decay=-1",
        "derive.batch_size=0", "derive.seq_len=4", "derive.block_sizes=[]", "derive.block_sizes=[0]",
        "derive.eval_tokens=0", "derive.precision=fp16", "derive.threads=-1", "derive.save_every_minutes=0",
        "derive.seed=-1", "derive.force=maybe", "derive.max_steps=true",
        "dflash.intermediate_size=4", "dflash.aux_layer_ids=[]", "dflash.aux_layer_ids=[-1]", "dflash.block_size=1",
        "dflash.mask_token_id=-1", "dflash.init_from_layers=[]", "dflash.draft_vocab_size=1", "dflash.num_layers=true",
        "train.windows_per_sequence=0", "train.micro_batch_size=0", "train.max_sequence_length=1",
        "train.cache_verifier_states=maybe", "train.activation_checkpointing=2", "train.weight_decay=-1",
        "trajectories.vllm_cpu_kv_cache_gib=0", "trajectories.num_prompts=0", "trajectories.store_topk=-1",
        "trajectories.completions_per_prompt=0", "trajectories.max_new_tokens=0",
        "serve_check.concurrency=[]", "serve_check.concurrency=[0]", "serve_check.vllm_cpu_kv_cache_gib=0",
        "serve_check.ngram=sometimes",
        # YAML 1.1 spellings that read as other numbers (010 is 8, 1:30 is 90): refused, not reinterpreted
        "decode.gamma=010", "train.max_steps=1:30", "derive.max_steps=010", "train.lr=1:30.5", "prompts.num_prompts=0o12",
    ]
    for override in values:
        key = override.split("=")[0]
        add(refuse(f"validate {override}", "35", ["validate", "{R}", override], key,
                   ci=override.startswith(("prompts.num_prompts", "derive.max_steps", "decode.gamma"))))

    # --- align memory ---------------------------------------------------------------------------------------------
    memory = [
        ("memory.out is the recipe itself", [f"memory.out={S}/recipes/base.yaml"], "align memory did not write it"),
        ("memory.out a folder", [f"memory.out={S}/work"], "is a folder"),
        ("memory.out under a file", [f"memory.out={S}/work/notes.txt/m.json"], "memory.out"),
        ("memory.out a user's file", [f"memory.out={S}/work/notes.txt"], "align memory did not write it"),
        ("memory.device cuda without a GPU", ["memory.device=cuda"], "memory.device"),
        ("a missing drafter", [f"drafter.path={S}/models/missing"], "drafter.path"),
        ("the verifier as drafter", [f"drafter.path={S}/ck/verifier"], "drafter.path"),
        ("a drafter without config.json", [f"drafter.path={S}/models/no_config"], "drafter.path"),
        ("a prompt past the drafter's context", ["memory.prompt_tokens=100000"], "exceed the drafter's context"),
    ]
    for what, extra, expect in memory:
        add(refuse(f"memory: {what}", "35", ["memory", "{R}", *extra], expect, ci=what.startswith("memory.out")))

    # --- align convert --------------------------------------------------------------------------------------------
    converts = [
        ("a package that is not installed", ["convert.source=pip:no-such-weights-package"], "is not installed"),
        ("a missing GGUF", [f"convert.source={S}/none.gguf"], "no such file"),
        ("a file that is not a GGUF", [f"convert.source={S}/work/notes.txt"], "not a .gguf"),
        ("a folder with neither GGUF nor config", [f"convert.source={S}/work"], "convert.source"),
        ("a Hub id", ["convert.source=HuggingFaceTB/SmolLM2-135M-Instruct"], "not a local file or folder"),
        ("gguf_file missing from a folder", [f"convert.source={S}/work", "convert.gguf_file=x.gguf"], "does not exist"),
        ("sha256 pinned on a transformers folder", [f"convert.source={S}/ck/verifier", "convert.sha256=" + "0" * 64],
         "convert.sha256"),
        # the verifier folder is align bootstrap's: refused as another stage's output before it is read as a source
        ("out is the source folder", [f"convert.source={S}/ck/verifier", f"convert.out={S}/ck/verifier"],
         "convert.out"),
        ("out a model folder convert did not write", [f"convert.source={S}/ck/verifier",
                                                      f"convert.out={S}/ck/drafter-base"], "convert.out"),
        ("out a folder of the user's files", [f"convert.source={S}/ck/verifier", f"convert.out={S}/work"],
         "convert.out"),
        ("out an existing file", [f"convert.source={S}/ck/verifier", f"convert.out={S}/work/notes.txt"],
         "convert.out"),
    ]
    for what, extra, expect in converts:
        add(refuse(f"convert: {what}", "35", ["convert", "{R}", f"convert.out={S}/out/c", *extra], expect, ci=True))

    # --- align prompts (Magpie) -----------------------------------------------------------------------------------
    chat = f"verifier.path={S}/models/chat_verifier"
    prompts = [
        ("a verifier without a chat template", [], "has no chat template", None),
        ("data.chat_template off", [chat, "data.chat_template=off"], "data.chat_template", None),
        ("prompts.out an existing file", [chat, f"prompts.out={S}/work/notes.txt"], "prompts.out", None),
        ("prompts.out holding other settings", [chat, f"prompts.out={S}/bad/prompts"], "other settings",
         prompts_folder("manifest.json", '{"stage": "prompts", "settings_hash": "0123456789abcdef"}')),
        ("a torn raw chunk", [chat, f"prompts.out={S}/bad/prompts"], "is not a chunk of samples",
         prompts_folder("raw/chunk-00000.json", '{"settings_hash": "x", "samples": [{"ids": [1')),
        ("a raw chunk of other settings", [chat, f"prompts.out={S}/bad/prompts"], "other settings",
         prompts_folder("raw/chunk-00000.json", json.dumps({"settings_hash": "x", "samples": [
             {"ids": [5], "ended": True, "text": "hi"}]}))),
        ("prompts.out another stage's folder", [chat, f"prompts.out={S}/traj"], "prompts.out", None),
        ("an edited raw chunk", [chat, f"prompts.out={S}/bad/prompts"], "is not as it was written", edited_chunk),
        ("vLLM without its environment", [chat, "prompts.backend=vllm"], "prompts.backend", None),
        ("a missing verifier", [f"verifier.path={S}/models/missing"], "verifier.path", None),
        ("a diffusion drafter as verifier", [f"verifier.path={S}/ck/drafter-base"], "verifier.path", None),
    ]
    for what, extra, expect, setup in prompts:
        env = {"ALIGN_VLLM_PYTHON": f"{S}/none/python"} if "vllm" in " ".join(extra) else {}
        add(refuse(f"prompts: {what}", "35", ["prompts", "{R}", f"prompts.out={S}/out/p", *extra], expect,
                   setup=setup, env=env, ci=True))

    # --- align derive ---------------------------------------------------------------------------------------------
    derives = [
        ("layers past the verifier's", ["derive.layers=[0, 99]"], "derive.layers"),
        ("every layer kept", ["derive.num_layers=99"], "derive.num_layers"),
        ("seq_len past the context", ["derive.seq_len=100000"], "derive.seq_len"),
        ("a mask token for an AR drafter", ["derive.drafter=ar", "derive.mask_token_id=3"], "derive.mask_token_id"),
        ("a mask token outside the vocabulary", ["derive.mask_token_id=100000"], "derive.mask_token_id"),
        ("no trajectories", [f"trajectories.out={S}/out/none"], "trajectories.out"),
        ("trajectories of other settings", ["trajectories.temperature=0.9"], "trajectories.temperature"),
        ("out an existing file", [f"derive.out={S}/work/notes.txt"], "derive.out"),
        ("out a model folder derive did not write", [f"derive.out={S}/ck/ar-drafter"], "derive.out"),
        ("a diffusion drafter as verifier", [f"verifier.path={S}/ck/drafter-base"], "verifier.path"),
        ("a verifier without config.json", [f"verifier.path={S}/models/no_config"], "verifier.path"),
    ]
    for what, extra, expect in derives:
        # the toy verifier has one layer: derive.layers=[0] keeps it, where the default 4 would be refused first
        keep = [] if what.startswith(("layers", "every layer")) else ["derive.layers=[0]"]
        add(refuse(f"derive: {what}", "35", ["derive", "{R}", f"derive.out={S}/out/d", *keep, *extra], expect,
                   ci=True))

    # --- DFlash training: every refusal before the run folder is marked (a refusal never poisons it) -------------
    dflash = "dflash={aux_layer_ids: [0], intermediate_size: 64}"
    trains = [
        ("aux_layer_ids past the verifier's", ["dflash.aux_layer_ids=[0, 99]"], "dflash.aux_layer_ids"),
        ("init_from_layers past the verifier's", ["dflash.init_from_layers=[99]"], "dflash.init_from_layers"),
        ("a draft vocabulary larger than the verifier's", ["dflash.draft_vocab_size=100000"],
         "dflash.draft_vocab_size"),
        ("a mask token outside the vocabulary", ["dflash.mask_token_id=100000"], "dflash.mask_token_id"),
        ("activation checkpointing", ["train.activation_checkpointing=true"], "activation_checkpointing"),
        ("a block too short for train.gamma", ["dflash.block_size=3", "train.gamma=4"], "gamma"),
    ]
    for what, extra, expect in trains:
        add(refuse(f"train dflash: {what}", "35", ["train", "{R}", dflash, *extra, f"train.out={S}/out/r"], expect,
                   sub=True))
    add(refuse("train from a speculators EAGLE-3 folder", "36", [
        "train", "{R}", f"drafter.path={S}/bad/eagle3", f"train.out={S}/out/r"], "eagle3", sub=True,
        setup=eagle3_folder))
    add(refuse("eval a speculators EAGLE-3 folder", "36", [
        "eval", "{R}", f"drafter.path={S}/bad/eagle3", f"eval.out={S}/out/e"], "eagle3", ci=True,
        setup=eagle3_folder))

    # --- align serve-check ----------------------------------------------------------------------------------------
    serves = [
        ("a missing drafter", [f"serve_check.drafter={S}/models/missing"], "serve_check.drafter"),
        ("a standalone drafter", [f"serve_check.drafter={S}/ck/drafter-base"], "serve_check.drafter"),
        ("gamma past the drafter's block", ["decode.gamma=9"], "decode.gamma"),
        ("more requests in flight than prompts", ["serve_check.concurrency=[1, 4]", "eval.num_prompts=2"],
         "serve_check.concurrency"),
    ]
    for what, extra, expect in serves:
        add(refuse(f"serve-check: {what}", "35", ["serve-check", "{R}", f"serve_check.out={S}/out/s", *extra],
                   expect))
    return table


def eagle3_folder(s: Sandbox) -> None:
    """S/bad/eagle3: the sandbox's DFlash drafter under a config that names another speculators algorithm."""
    linked_model(s.root / "dflash" / "step_1", s.root / "bad" / "eagle3").joinpath("config.json").write_text(
        json.dumps({"speculators_model_type": "eagle3"}))


def prompts_folder(name: str, content: str) -> Callable[[Sandbox], None]:
    """S/bad/prompts marked as align prompts' folder (what the stage writes first), holding `name`."""
    def setup(s: Sandbox) -> None:
        from align.disk import mark_folder

        mark_folder(s.root / "bad" / "prompts", "prompts")
        write(s.root / "bad" / "prompts" / name, content)
    return setup


def edited_chunk(s: Sandbox) -> None:
    """S/bad/prompts/raw/chunk-00000.json of these settings whose samples were edited after it was written."""
    from align.recipe_files import load_recipe
    from align.stages.prompts import plan, samples_sha256

    recipe = load_recipe(s.recipe, [f"verifier.path={s.root}/models/chat_verifier", f"prompts.out={s.root}/out/p"])
    samples = [{"ids": [5, 6], "ended": True, "text": "a message"}]
    chunk = {"settings_hash": plan(recipe).settings_hash, "chunk": 0, "seed": 0, "samples": samples,
             "samples_sha256": samples_sha256(samples)}
    chunk["samples"][0]["text"] = "an edited message"
    prompts_folder("raw/chunk-00000.json", json.dumps(chunk))(s)


def _pair(s: Sandbox, kind: str = "pair") -> Any:
    import align

    ck = s.root / "ck"
    if kind == "pair" and s.pair is None:
        s.pair = align.load(verifier=str(ck / "verifier"), drafter=str(ck / "drafter-base"),
                            ar_drafter=str(ck / "ar-drafter"), data_dir=str(s.root / "data"))
    if kind == "chat" and s.chat_pair is None:
        from test_chat_data import with_template

        folder = s.root.parent / "chat" / "verifier"  # beside the sandbox: not a case's doing
        s.chat_pair = align.load(verifier=str(with_template(ck / "verifier", folder)))
    if kind == "dflash" and s.dflash_pair is None:
        s.dflash_pair = align.load(verifier=str(ck / "verifier"), drafter=str(s.root / "dflash" / "step_1"))
    return {"pair": s.pair, "chat": s.chat_pair, "dflash": s.dflash_pair}[kind]


def api(name: str, finding: str, call: Callable[[Sandbox], Any], expect: Optional[str] = None, **kw: Any) -> Case:
    return Case(name, finding, api=call, expect=expect, ci=True, **kw)


def api_cases() -> list[Case]:
    import torch

    def load(**kwargs: Any) -> Callable[[Sandbox], Any]:
        def call(s: Sandbox) -> Any:
            import align

            ck = s.root / "ck"
            given = {"verifier": str(ck / "verifier"), **{k: v.replace("{S}", str(s.root)) if isinstance(v, str) else v
                                                          for k, v in kwargs.items()}}
            return align.load(**given)
        return call

    def gen(*args: Any, kind: str = "pair", **kwargs: Any) -> Callable[[Sandbox], Any]:
        return lambda s: _pair(s, kind).generate(*args, **kwargs)

    table = [
        api("load: a missing verifier", "-", load(verifier="{S}/none"), "verifier.path"),
        api("load: the verifier as drafter", "-", load(drafter="{S}/ck/verifier"), "is the verifier"),
        api("load: an AR drafter as drafter", "-", load(drafter="{S}/ck/ar-drafter"), "not a diffusion drafter"),
        api("load: a diffusion drafter as AR drafter", "-", load(ar_drafter="{S}/ck/drafter-base"), "diffusion"),
        api("load: a truncated drafter", "-", load(drafter="{S}/models/truncated"), "truncated"),
        api("load: dtype fp8", "-", load(dtype="fp8"), "verifier.dtype"),
        api("load: a misspelt setting", "-", load(tempreature=0.5), "did you mean"),
        api("load: a drafter mapping with an unknown field", "-",
            load(drafter={"path": "x", "logit_shift": 1}), "unknown field"),
        api("load: a drafter given as a number", "-", load(drafter=3), "drafter"),
        api("load: chat_template on without one", "-", load(chat_template="on"), "data.chat_template"),
        api("load: seed 2**70", "10", load(seed=2**70), "decode.seed"),
        api("load: eos_token_id a string", "-", load(eos_token_id="</s>"), "eos_token_id"),
        api("generate: an unknown method", "-", gen(["def f():"], method="medusa"), "unknown"),
        api("generate: no prompts", "-", gen([], method="ar"), "empty"),
        api("generate: an empty prompt", "-", gen("", method="ar"), "empty"),
        api("generate: a tensor of prompts", "-", gen(torch.tensor([[1, 2]]), method="ar"), "prompts"),
        api("generate: token ids outside the vocabulary", "-", gen([[1, 10**6]], method="ar"), "vocabulary"),
        api("generate: float token ids", "-", gen([[1.5, 2.0]], method="ar"), "a prompt is"),
        api("generate: a malformed message", "-", gen([[{"role": "user", "content": 3}]], method="ar"), "message 0"),
        api("generate: messages without a chat template", "-", gen([[{"role": "user", "content": "hi"}]], method="ar"),
            "chat template"),
        api("generate: a prompt past the context", "-", gen(["x " * 3000], method="ar"), "exceeds"),
        api("generate: max_new_tokens=0", "-", gen("def f():", method="ar", max_new_tokens=0), "max_new_tokens"),
        api("generate: temperature -1", "-", gen("def f():", method="ar", temperature=-1), "temperature"),
        api("generate: gamma 0", "-", gen("def f():", method="specdiff", gamma=0), "gamma"),
        api("generate: top_p 2", "-", gen("def f():", method="ar", top_p=2), "top_p"),
        api("generate: seed 2**70", "10", gen("def f():", method="ar", seed=2**70, max_new_tokens=2), "decode.seed"),
        api("generate: seed -1", "10", gen("def f():", method="ar", seed=-1, max_new_tokens=2), "decode.seed"),
        api("generate: eos_token_id a string", "-", gen("def f():", method="ar", eos_token_id="</s>"), "eos_token_id"),
        api("generate: eos_token_id a float tensor", "10", gen("def f():", method="ar", eos_token_id=torch.tensor(1.5)),
            "eos_token_id"),
        api("generate: an assistant-only conversation", "7",
            gen([[{"role": "assistant", "content": "a"}]], method="ar", kind="chat"), "only assistant turns"),
        api("generate: specdiff2_select with a DFlash drafter", "-", gen("def f():", method="specdiff2_select",
            kind="dflash"), "DFlash"),
        # issue 35: values are what they look like, and sizes are bounded by what the machine can hold
        api("load: no verifier", "35", lambda s: __import__("align").load(verifier=None), "verifier"),
        api("load: data_dir a file", "35", load(data_dir="{S}/work/notes.txt"), "data_dir"),
        api("load: dtype True", "35", load(dtype=True), "dtype"),
        api("load: max_new_tokens True", "35", load(max_new_tokens=True), "max_new_tokens"),
        api("load: chat_template maybe", "35", load(chat_template="maybe"), "chat_template"),
        api("load: a speculators EAGLE-3 folder", "36", load(drafter="{S}/bad/eagle3"), "eagle3",
            setup=eagle3_folder),
        api("generate: gamma True", "35", gen("def f():", method="specdiff", gamma=True), "gamma"),
        api("generate: temperature True", "35", gen("def f():", method="ar", temperature=True), "temperature"),
        api("generate: max_new_tokens True", "35", gen("def f():", method="ar", max_new_tokens=True),
            "max_new_tokens"),
        api("generate: seed True", "35", gen("def f():", method="ar", seed=True), "seed"),
        api("generate: top_k True", "35", gen("def f():", method="ar", top_k=True), "top_k"),
        api("generate: max_new_tokens 2.5", "35", gen("def f():", method="ar", max_new_tokens=2.5), "max_new_tokens"),
        api("generate: eos_token_id past the vocabulary", "35", gen("def f():", method="ar", eos_token_id=10**9),
            "eos_token_id"),
        api("generate: eos_token_id a list with one past the vocabulary", "35",
            gen("def f():", method="ar", eos_token_id=[2, 10**6]), "eos_token_id"),
        api("generate: tree_nodes a million", "35", gen("def f():", method="specdiff_tree", tree_nodes=10**6),
            "tree_nodes"),
        api("generate: tree_nodes True", "35", gen("def f():", method="specdiff_tree", tree_nodes=True), "tree_nodes"),
        api("generate: gamma a million", "35", gen("def f():", method="specdiff", gamma=10**6), "gamma"),
        api("generate: a lone surrogate in a prompt", "35", gen("def f(): \ud800", method="ar"), "prompt"),
        api("generate: None among the prompts", "35", gen(["def f():", None], method="ar"), "prompt"),
    ]

    def eos_tensor(s: Sandbox) -> Any:
        pair = _pair(s)
        as_int = pair.generate("def f():", method="ar", max_new_tokens=6, eos_token_id=5)[0].token_ids
        as_tensor = pair.generate("def f():", method="ar", max_new_tokens=6, eos_token_id=torch.tensor(5))[0].token_ids
        return as_int, as_tensor

    def same(s: Sandbox, r: Result) -> tuple[str, str]:
        if r.error is not None:
            return "other", f"refused: {r.error}"
        a, b = r.value
        return ("handled", "the same tokens as eos_token_id=5") if a == b else ("silent", f"{a} != {b}")

    table.append(Case("generate: eos_token_id a 0-d tensor", "10", api=eos_tensor, kind="fault", check=same, ci=True))

    def trailing_answer(s: Sandbox) -> Any:
        chat = _pair(s, "chat")
        question = [{"role": "user", "content": "def add(a, b):"}]
        answered = [*question, {"role": "assistant", "content": "    return a + b"}]
        asked, cut = chat.generate([question, answered], method="ar", max_new_tokens=2)
        return asked.prompt_token_ids, cut.prompt_token_ids

    def cut(s: Sandbox, r: Result) -> tuple[str, str]:
        if r.error is not None:
            return "other", f"refused: {r.error}"
        a, b = r.value
        return ("handled", "the trailing answer is cut, as the stages cut it") if a == b else (
            "silent", "the trailing assistant turn was kept in the prompt")

    table.append(Case("generate: a conversation ending with its answer", "7", api=trailing_answer, kind="fault",
                      check=cut, ci=True))
    return table


# --------------------------------------------------------------------------------------------------------------------
# the operator's faults: runs, resumes, signals, full disks, the README's scripts (other findings of issue 24)
# --------------------------------------------------------------------------------------------------------------------
def rewind(s: Sandbox) -> None:
    """S/run as a run killed just after step 2's checkpoint: step 3, its state and its metrics gone."""
    run = s.root / "run"
    shutil.rmtree(run / "step_3")
    shutil.rmtree(run / "ds_state" / "step_3")
    (run / "ds_state" / "latest").write_text("step_2")
    kept = [line for line in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["step"] <= 2 and "final_tau" not in line]
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))


def then(*steps: Callable[[Sandbox], Any]) -> Callable[[Sandbox], None]:
    def setup(s: Sandbox) -> None:
        for step in steps:
            step(s)
    return setup


def metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


PROGRESS_BAR = re.compile(r"\d+/\d+ \[")  # tqdm's "n/total [elapsed<remaining": progress, not something said


def said(stderr: str) -> list[str]:
    """What a command said on stderr: its lines, progress bars (\r-updated, or a line each when not a terminal) and
    warnings left out."""
    return [line for line in re.split(r"[\r\n]", stderr)
            if line.strip() and not PROGRESS_BAR.search(line) and "warning" not in line.lower()]


def resumed_cleanly(extra_steps: int) -> Callable[[Sandbox, Result], tuple[str, str]]:
    """A resume that continued (exit 0, one metrics row per step, steps 1..N) or refused in one line naming a file."""
    def check(s: Sandbox, r: Result) -> tuple[str, str]:
        lines = said(r.err)
        if r.code == 2 and len(lines) == 1:
            return "handled", lines[0][:150]
        if r.code != 0:
            return "other", f"exit {r.code}: {first_lines(r.err)}"
        try:
            rows = [row["step"] for row in metrics(s.root / "run") if "loss" in row]
        except ValueError as e:
            return "silent", f"metrics.jsonl left unreadable ({e})"
        want = list(range(1, 3 + extra_steps))  # the rewound run's 2 steps and the rest
        if rows != want:
            return "silent", f"metrics steps {rows}"
        # Exact: the losses an uninterrupted run had (the run as built).
        losses = [row["loss"] for row in metrics(s.root / "run") if "loss" in row]
        reference = [row["loss"] for row in metrics(s.pristine / "run") if "loss" in row][: len(losses)]
        if losses != reference:
            return "silent", f"resumed with other losses: {losses} vs {reference}"
        return "handled", f"resumed exactly: steps {rows}"
    return check


def torn_throughput(s: Sandbox, r: Result) -> tuple[str, str]:
    """`align throughput` on a log whose last line was cut: the cut line dropped and said, the rest read, no NaN."""
    if r.code == 0 and "metrics.jsonl" in r.err and "cut short" in r.err and "nan" not in r.out:
        return "handled", f"the cut line said and dropped: {r.out.strip().splitlines()[-1][:100]}"
    return ("silent" if r.code == 0 else "other"), f"exit {r.code}: {first_lines(r.out + r.err)}"


def one_line_naming(path_part: str) -> Callable[[Sandbox, Result], tuple[str, str]]:
    """A full disk: a non-zero exit with one line that names the path, and nothing older damaged."""
    def check(s: Sandbox, r: Result) -> tuple[str, str]:
        lines = said(r.err)
        if r.code == 0:
            return "silent", "exit 0 on a full disk"
        if len(lines) == 1 and path_part in lines[0]:
            return "handled", lines[0][:150]
        return "other", f"exit {r.code}, {len(lines)} lines: {first_lines(r.err)}"
    return check


def popen_child(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """The child entry point in its own process group, stdout and stderr into files: a pipe would be held open by the
    processes it starts, and reading it would wait for them."""
    marker = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", marker, "--", *argv],
                            stdout=open(log.with_suffix(".out"), "w"), stderr=open(log.with_suffix(".err"), "w"),
                            text=True, env=env, start_new_session=True)


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return True
        time.sleep(0.5)
    return False


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def rows_of(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def interrupt_run(whole_group: bool) -> Callable[[Sandbox], Result]:
    """`align train --num_gpus 2`, interrupted once it trains: SIGINT to align alone (timeout -s INT, schedulers) or to
    its whole process group (a terminal's Ctrl-C). Result.err is what was written after the signal."""
    def run(s: Sandbox) -> Result:
        out = s.root / "out" / "sigint"
        log = s.root.parent / "logs" / ("sigint-group" if whole_group else "sigint")
        proc = popen_child(["train", str(s.recipe), "--num_gpus", "2", f"train.out={out}", "train.max_steps=100000",
                            "train.save_every=100000", "train.eval_every=100000", "train.final_eval_prompts=0"],
                           child_env(), log)
        started = wait_for(lambda: rows_of(out / "metrics.jsonl") > 0, 300)
        before = log.with_suffix(".err").stat().st_size
        (os.killpg(proc.pid, signal.SIGINT) if whole_group else proc.send_signal(signal.SIGINT))
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        at_exit = rows_of(out / "metrics.jsonl")
        time.sleep(5)
        note = {"started": started, "exited": proc.poll() is not None, "alive": group_alive(proc.pid),
                "rows": at_exit, "later": rows_of(out / "metrics.jsonl")}
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        err = log.with_suffix(".err").read_text(errors="replace")[before:]
        if before and not err[:1] in "\r\n":  # the signal came mid-line (a progress bar's): that line was before it
            err = re.split(r"[\r\n]", err, maxsplit=1)[-1]
        return Result(proc.returncode, "", err, [], value=note)
    return run


def interrupted_cleanly(s: Sandbox, r: Result) -> tuple[str, str]:
    note = r.value
    if not note["started"]:
        return "other", "training never started"
    if not note["exited"]:
        return "other", "align did not exit within 60 s of the signal"
    if note["alive"] or note["later"] > note["rows"]:
        return "silent", (f"exit {r.code}; its ranks kept training after align exited (metrics rows {note['rows']} -> "
                          f"{note['later']} in 5 s)")
    lines = said(r.err)
    if r.code == 130 and len(lines) == 1:
        return "handled", f"every process stopped: {lines[0]}"
    return "other", f"exit {r.code}, {len(lines)} lines after the signal: {first_lines(r.err)}"


def two_runs(s: Sandbox) -> Result:
    """A second run into the train.out of a run in progress."""
    out = s.root / "out" / "twice"
    first = popen_child(["train", str(s.recipe), f"train.out={out}", "train.max_steps=100000", "train.save_every=1",
                         "train.final_eval_prompts=0"], child_env(), s.root.parent / "logs" / "first-run")
    try:
        wait_for(lambda: (out / "ds_state" / "latest").is_file(), 300)
        # The same command: only the lock can refuse it (a shorter max_steps is refused first, for its own reason).
        code, stdout, stderr, built = run_child(["train", str(s.recipe), f"train.out={out}", "train.max_steps=100000",
                                                 "train.save_every=1", "train.final_eval_prompts=0"])
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    return Result(code, stdout, stderr, built)


def operator_cases() -> list[Case]:
    S = "{S}"
    R = "{R}"
    table = [
        # 1: export replaces a folder it did not write
        refuse("export.out names a training run", "1", ["export", R, f"export.out={S}/run"], "export.out",
               needs=("run",)),
        refuse("export.out names the working folder", "1", ["export", R, f"export.out={S}/work"], "export.out"),
        # 2: a refused bootstrap has already written data.dir
        refuse("bootstrap refused after writing data.dir", "2", [
            "bootstrap", str(ROOT / "recipes/tiny/bootstrap.yaml"), f"bootstrap.out={S}/out/ck", f"data.dir={S}/data",
            *TOY, "bootstrap.corpus_fraction=0.05"], "corpus_fraction"),
        # 3: resume whatever the recipe now says
        refuse("train.out resumed with another drafter", "3", ["train", R, f"drafter.path={S}/models/other_drafter"],
               "drafter.path", sub=True, needs=("run",), setup=rewind, may_change=("run/*",)),
        refuse("train.out resumed with another learning rate", "3", ["train", R, "train.lr=1e-3"], "train.lr",
               sub=True, needs=("run",), setup=rewind, may_change=("run/*",)),
        # 4: two runs into one train.out
        Case("a second run into a running train.out", "4", run=two_runs, expect="in use by another align run",
             writes_ok=("out", "out/twice*", "out/.twice*")),  # the first run's folder and its lock file
        # 5: Ctrl-C on two ranks
        Case("SIGINT to align train --num_gpus 2", "5", run=interrupt_run(False), kind="fault",
             check=interrupted_cleanly),
        Case("Ctrl-C (the group) on align train --num_gpus 2", "5", run=interrupt_run(True), kind="fault",
             check=interrupted_cleanly),
        # 7: a finished run rerun; the learning rate logged
        Case("a finished run rerun", "7", argv=["train", R], kind="fault", sub=True, needs=("run",),
             may_change=("run/*",), check=lambda s, r: (
                 ("handled", "one final_tau row") if r.code == 0 and sum("final_tau" in row for row in metrics(
                     s.root / "run")) == 1 else ("silent", f"exit {r.code}, final_tau rows: "
                                                 f"{sum('final_tau' in row for row in metrics(s.root / 'run'))}"))),
        Case("the learning rate of a 1-step run", "7", argv=["train", R, f"train.out={S}/out/lr", "train.max_steps=1",
             "train.final_eval_prompts=0"], kind="fault", sub=True, check=lambda s, r: (
                 ("handled", "lr 3e-3, the rate the step used") if r.code == 0 and metrics(s.root / "out" / "lr")[0][
                     "lr"] == 3e-3 else ("silent", f"exit {r.code}, lr logged "
                                         f"{metrics(s.root / 'out' / 'lr')[0]['lr'] if r.code == 0 else '?'}"))),
        # 8: torn and dangling state, on a run killed after step 2's checkpoint
        Case("resume after a torn metrics.jsonl line", "8", argv=["train", R], kind="fault", sub=True,
             needs=("run",), may_change=("run/*",), check=resumed_cleanly(1), setup=then(
                 rewind, lambda s: open(s.root / "run" / "metrics.jsonl", "a").write('{"step": 3, "lo'))),
        Case("resume with an empty ds_state/latest", "8", argv=["train", R], kind="fault", sub=True, needs=("run",),
             may_change=("run/*",), check=resumed_cleanly(1), setup=then(
                 rewind, lambda s: (s.root / "run" / "ds_state" / "latest").write_text(""))),
        Case("resume with a dangling ds_state/latest", "8", argv=["train", R], kind="fault", sub=True, needs=("run",),
             may_change=("run/*",), check=resumed_cleanly(1), setup=then(
                 rewind, lambda s: (s.root / "run" / "ds_state" / "latest").write_text("step_9"))),
        Case("resume with a truncated DeepSpeed state", "8", argv=["train", R], kind="fault", sub=True,
             needs=("run",), may_change=("run/*",), check=resumed_cleanly(1), setup=then(
                 rewind, lambda s: [p.write_bytes(p.read_bytes()[:200]) for p in
                                    (s.root / "run" / "ds_state" / "step_2").glob("*model_states.pt")])),
        Case("a killed run resumed", "-", argv=["train", R], kind="fault", sub=True, needs=("run",),
             may_change=("run/*",), check=resumed_cleanly(1), setup=rewind),
        # 9: a full disk
        # eval.json itself goes through write_result, which keeps it elsewhere when the disk refuses it
        # (tests/test_faults.py); the report beside it is the write after it.
        Case("disk full at eval's report write", "9", argv=["eval", R, f"eval.out={S}/out/e"], kind="fault",
             faults="align.stages.evaluate.speculative:write_text_atomic", check=one_line_naming("report.md")),
        Case("disk full during export", "9", argv=["export", R, f"export.out={S}/out/x"], kind="fault",
             faults="align.stages.export:atomic_folder", check=one_line_naming("out/x")),
        Case("disk full during trajectories", "9", argv=["trajectories", R, f"trajectories.out={S}/out/t"],
             kind="fault", faults="align.stages.trajectories:write_chunk", check=one_line_naming("out/t")),
        Case("disk full at train's state save", "9", argv=["train", R, f"train.out={S}/out/r", "train.max_steps=1",
             "train.final_eval_prompts=0"], kind="fault", sub=True, faults="align.stages.train:save_checkpoint",
             check=one_line_naming("out/r")),
        # 12: the README's scripts share outputs
        Case("README scripts: shared outputs agree", "12", api=lambda s: readme_scripts_agree(), kind="fault",
             check=lambda s, r: ("handled", "every shared output made with the same settings") if not r.value else (
                 "silent", f"{r.value}")),
    ]
    return table


def readme_scripts_agree() -> list[str]:
    """Outputs two of experiments/tiny_*.sh's recipes share (trajectories.out) must be made with the same settings."""
    from align.recipe_files import load_recipe

    recipes = {name: load_recipe(ROOT / "recipes" / "tiny" / name) for name in ("align.yaml", "dflash.yaml")}
    by_out: dict[str, list[tuple[str, Any]]] = {}
    for name, recipe in recipes.items():
        settings = (recipe.verifier.path, recipe.trajectories.model_dump(), recipe.data.model_dump(), recipe.train.seed)
        by_out.setdefault(recipe.trajectories.out, []).append((name, settings))
    return [f"{out}: {', '.join(n for n, _ in made)} make it with other settings" for out, made in by_out.items()
            if len({json.dumps(s, sort_keys=True) for _, s in made}) > 1]


# --------------------------------------------------------------------------------------------------------------------
# issue 52: what align did not write (foreign drafter folders, DeepSpeed JSON, prompt mixtures, launcher flags)
# --------------------------------------------------------------------------------------------------------------------
def spec_edit(base: str, config: Optional[Callable[[dict], Any]] = None,
              weights: Optional[Callable[[dict], Any]] = None) -> Callable[[Sandbox], None]:
    """A setup: S/bad/spec, a copy of S/spec/<base> (a speculators DFlash folder) with its config.json and/or its
    weights edited in place by the given functions."""
    def setup(s: Sandbox) -> None:
        from safetensors.torch import load_file, save_file

        folder = s.root / "bad" / "spec"
        shutil.copytree(s.root / "spec" / base, folder)
        if config is not None:
            raw = json.loads((folder / "config.json").read_text())
            config(raw)
            (folder / "config.json").write_text(json.dumps(raw))
        if weights is not None:
            tensors = load_file(str(folder / "model.safetensors"))
            weights(tensors)
            save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return setup


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """An edit setting the dotted key `path` of a JSON object to `value`."""
    def edit(raw: dict) -> None:
        *parents, last = path.split(".")
        for part in parents:
            raw = raw[part]
        raw[last] = value
    return edit


def _drop(path: str) -> Callable[[dict], None]:
    def edit(raw: dict) -> None:
        *parents, last = path.split(".")
        for part in parents:
            raw = raw[part]
        raw.pop(last)
    return edit


def _reshape(name: str) -> Callable[[dict], None]:
    """Half of a weight's last dimension (a 1-D norm: half its length)."""
    return lambda t: t.__setitem__(name, t[name][..., : t[name].shape[-1] // 2].contiguous())


LAYER_WEIGHTS_52 = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                    "post_attention_layernorm.weight")


def foreign_cases() -> list[Case]:
    """Issue 52: folders and files align did not write, each refused in one line naming the key before any model is
    built: a speculators folder edited key by key and weight by weight, folders of one format where another is read,
    a user's DeepSpeed JSON, prompt mixtures, and the launcher flags passed on to DeepSpeed."""
    import torch

    S = "{S}"
    table: list[Case] = []
    add = table.append
    tl = "transformer_layer_config"

    # --- a speculators DFlash folder's config.json, key by key (align eval reads it as drafter.path) ------------
    configs: list[tuple[str, Callable[[dict], None], str]] = []
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        configs += [(f"{tl}.{key} removed", _drop(f"{tl}.{key}"), f"{tl}.{key} is missing"),
                    (f"{tl}.{key} a string", _set(f"{tl}.{key}", "32"), f"{tl}.{key} is '32'"),
                    (f"{tl}.{key} 0", _set(f"{tl}.{key}", 0), f"{tl}.{key} is 0")]
    configs += [
        (f"{tl} removed", _drop(tl), f"{tl} is missing"), (f"{tl} a string", _set(tl, "qwen3"), f"{tl} is str"),
        (f"{tl}.num_key_value_heads not dividing the heads", _set(f"{tl}.num_key_value_heads", 3), "does not divide"),
        (f"{tl}.head_dim 0", _set(f"{tl}.head_dim", 0), "head_dim is 0"),
        (f"{tl}.rms_norm_eps negative", _set(f"{tl}.rms_norm_eps", -1e-6), "rms_norm_eps"),
        (f"{tl}.rope_theta a string", _set(f"{tl}.rope_theta", "big"), "rope_theta"),
        (f"{tl}.max_position_embeddings 0", _set(f"{tl}.max_position_embeddings", 0), "max_position_embeddings"),
        (f"{tl}.hidden_act gelu", _set(f"{tl}.hidden_act", "gelu"), "hidden_act is 'gelu'"),
        (f"{tl}.attention_bias true", _set(f"{tl}.attention_bias", True), "attention_bias"),
        (f"{tl}.layer_types sliding", _set(f"{tl}.layer_types", ["sliding_attention"]), "layer_types"),
        (f"{tl}.rope_parameters yarn", _set(f"{tl}.rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}),
         "rope_type is 'yarn'"),
        ("aux_hidden_state_layer_ids removed", _drop("aux_hidden_state_layer_ids"), "aux_hidden_state_layer_ids"),
        ("aux_hidden_state_layer_ids a number", _set("aux_hidden_state_layer_ids", 0), "aux_hidden_state_layer_ids"),
        ("aux_hidden_state_layer_ids empty", _set("aux_hidden_state_layer_ids", []), "aux_hidden_state_layer_ids"),
        ("aux_hidden_state_layer_ids negative", _set("aux_hidden_state_layer_ids", [-1]),
         "aux_hidden_state_layer_ids"),
        ("aux_hidden_state_layer_ids booleans", _set("aux_hidden_state_layer_ids", [True]),
         "aux_hidden_state_layer_ids"),
        ("aux_hidden_state_layer_ids past the verifier's depth", _set("aux_hidden_state_layer_ids", [1]),
         "must be below the verifier's 1 layers"),
        ("mask_token_id removed", _drop("mask_token_id"), "mask_token_id is missing"),
        ("mask_token_id a string", _set("mask_token_id", "3"), "mask_token_id is '3'"),
        ("mask_token_id negative", _set("mask_token_id", -1), "mask_token_id is -1"),
        ("mask_token_id past the vocabulary", _set("mask_token_id", 10 ** 6), "mask_token_id is 1000000"),
        ("block_size 1", _set("block_size", 1), "block_size is 1"),
        ("block_size a string", _set("block_size", "5"), "block_size"),
        ("draft_vocab_size 0", _set("draft_vocab_size", 0), "draft_vocab_size is 0"),
        ("draft_vocab_size past the vocabulary", _set("draft_vocab_size", 10 ** 6), "draft_vocab_size is 1000000"),
        ("target_hidden_size 0", _set("target_hidden_size", 0), "target_hidden_size is 0"),
        ("target_hidden_size narrower than the verifier's", _set("target_hidden_size", 16), "fc.weight"),
        ("speculators_model_type eagle3", _set("speculators_model_type", "eagle3"), "speculators eagle3 drafter"),
        ("speculators_model_type removed", _drop("speculators_model_type"), "model_type"),
        ("config.json a list", lambda raw: raw.clear(), "model_type"),
    ]
    for what, edit, expect in configs:
        add(refuse(f"speculators folder: {what}", "52", ["eval", "{R}", f"drafter.path={S}/bad/spec",
                                                         f"eval.out={S}/out/e"], expect, setup=spec_edit("full", edit)))

    # --- its weights: every one removed, some reshaped, renamed, retyped; a pruned vocabulary's maps -------------
    names = ["fc.weight", "hidden_norm.weight", "norm.weight", *(f"layers.0.{n}" for n in LAYER_WEIGHTS_52)]
    weights: list[tuple[str, str, Callable[[dict], None], str]] = [
        (f"{name} removed", "full", (lambda n: lambda t: t.pop(n))(name), f"{name} is missing") for name in names]
    weights += [
        ("fc.weight reshaped", "full", _reshape("fc.weight"), "fc.weight is [32, 16]"),
        ("a q_proj reshaped", "full", _reshape("layers.0.self_attn.q_proj.weight"), "q_proj.weight is [32, 16]"),
        ("norm.weight reshaped", "full", _reshape("norm.weight"), "norm.weight is [16]"),
        ("fc.weight renamed", "full", lambda t: t.__setitem__("fc.bias", t.pop("fc.weight")), "fc.weight is missing"),
        ("a layer renamed", "full", lambda t: t.update({k.replace("layers.0.", "layers.1."): t.pop(k) for k in list(t)
                                                        if k.startswith("layers.0.")}), "is missing"),
        ("an integer weight", "full", lambda t: t.__setitem__("norm.weight", t["norm.weight"].long()),
         "norm.weight is I64"),
        ("a second layer's weight", "full", lambda t: t.__setitem__("layers.1.mlp.up_proj.weight",
                                                                    t["layers.0.mlp.up_proj.weight"].clone()),
         "layers.1.mlp.up_proj.weight is no weight"),
        ("a wrong copy of the verifier's embeddings", "full",
         lambda t: t.__setitem__("embed_tokens.weight", torch.zeros(4, 32)), "embed_tokens.weight is [4, 32]"),
        ("d2t removed", "pruned", lambda t: t.pop("d2t"), "d2t is missing"),
        ("the pruned lm_head removed", "pruned", lambda t: t.pop("lm_head.weight"), "lm_head.weight is missing"),
        ("d2t a float", "pruned", lambda t: t.__setitem__("d2t", t["d2t"].float()), "d2t is F32"),
        ("d2t outside the vocabulary", "pruned", lambda t: t.__setitem__("d2t", t["d2t"] + 10 ** 5),
         "outside the verifier's vocabulary"),
        ("d2t descending", "pruned", lambda t: t.__setitem__("d2t", t["d2t"].flip(0).contiguous()), "ascending"),
        ("t2d not marking d2t's ids", "pruned", lambda t: t.__setitem__("t2d", torch.zeros_like(t["t2d"])),
         "t2d does not mark"),
        ("t2d reshaped", "pruned", lambda t: t.__setitem__("t2d", t["t2d"][:10].contiguous()), "t2d is [10]"),
    ]
    for what, base, edit, expect in weights:
        add(refuse(f"speculators weights: {what}", "52", ["eval", "{R}", f"drafter.path={S}/bad/spec",
                                                          f"eval.out={S}/out/e"], expect,
                   setup=spec_edit(base, weights=edit)))
    add(refuse("speculators weights: none", "52", ["eval", "{R}", f"drafter.path={S}/bad/spec", f"eval.out={S}/out/e"],
               "has no weights", setup=lambda s: (spec_edit("full")(s), (s.root / "bad/spec/model.safetensors").unlink())))
    add(refuse("speculators weights: torn", "52", ["eval", "{R}", f"drafter.path={S}/bad/spec", f"eval.out={S}/out/e"],
               "truncated or corrupt", setup=lambda s: (spec_edit("full")(s), (s.root / "bad/spec/model.safetensors")
                                                        .write_bytes(b"\x08" + b"\x00" * 7 + b"{}"))))

    # --- the same folders through the other readers: compare_drafters, align.load, train, calibrate, dllm eval ---
    others = [
        ("eval.compare_drafters", ["eval", "{R}", f"eval.compare_drafters={{x: {S}/bad/spec}}", f"eval.out={S}/out/e"],
         "eval.compare_drafters.x"),
        ("train from it", ["train", "{R}", f"drafter.path={S}/bad/spec", f"train.out={S}/out/r"], "drafter.path"),
    ]
    for label, argv, expect in others:
        for what, base, edit in (("fc.weight removed", "full", {"weights": lambda t: t.pop("fc.weight")}),
                                 ("d2t removed", "pruned", {"weights": lambda t: t.pop("d2t")}),
                                 ("transformer_layer_config removed", "full", {"config": _drop(tl)})):
            add(refuse(f"{label}: speculators {what}", "52", argv, expect, setup=spec_edit(base, **edit),
                       sub=argv[0] == "train"))

    def load(drafter: str, **kwargs: Any) -> Callable[[Sandbox], Any]:
        def call(s: Sandbox) -> Any:
            import align

            return align.load(verifier=str(s.root / "ck" / "verifier"), drafter=drafter.replace("{S}", str(s.root)),
                              device="cpu", **kwargs)
        return call

    for what, base, edit, expect in [
            ("layer ids past the verifier's depth", "full", {"config": _set("aux_hidden_state_layer_ids", [3])},
             "must be below the verifier's 1 layers"),
            ("fc.weight reshaped", "full", {"weights": _reshape("fc.weight")}, "fc.weight is [32, 16]"),
            ("d2t removed", "pruned", {"weights": lambda t: t.pop("d2t")}, "d2t is missing"),
            ("no transformer_layer_config", "full", {"config": _drop(tl)}, f"{tl} is missing"),
            ("no model_type, dtype auto", "full", {"config": _drop("speculators_model_type")}, "model_type"),
            ("a gelu MLP", "full", {"config": _set(f"{tl}.hidden_act", "gelu")}, "hidden_act")]:
        add(Case(f"load: speculators {what}", "52", api=load(f"{S}/bad/spec", dtype="auto"), expect=expect,
                 setup=spec_edit(base, **edit)))
    # dtype auto read a speculators config.json with transformers' AutoConfig, which needs a model_type it has not
    add(Case("load: an unedited speculators folder, dtype auto", "52", api=load(f"{S}/spec/full", dtype="auto"),
             kind="fault", check=lambda s, r: ("handled", "loaded") if r.error is None else
             ("other", f"{type(r.error).__name__}: {r.error}"[:150])))

    # --- a folder of one format where another is read ------------------------------------------------------------
    formats = [
        ("a speculators folder as verifier", ["eval", "{R}", f"verifier.path={S}/spec/full", "eval.methods=[ar]",
                                              f"eval.out={S}/out/e"], "verifier.path"),
        ("a speculators folder as AR drafter", ["eval", "{R}", f"ar_drafter.path={S}/spec/full",
                                                "eval.methods=[sd_ar]", f"eval.out={S}/out/e"], "ar_drafter.path"),
        ("an align DFlash folder as AR drafter", ["eval", "{R}", f"ar_drafter.path={S}/dflash/step_1",
                                                  "eval.methods=[sd_ar]", f"eval.out={S}/out/e"], "ar_drafter.path"),
        ("the verifier as a compared drafter", ["eval", "{R}", f"eval.compare_drafters={{v: {S}/ck/verifier}}",
                                                f"eval.out={S}/out/e"], "eval.compare_drafters.v"),
        ("an EAGLE-3 folder as a compared drafter", ["eval", "{R}", f"eval.compare_drafters={{e: {S}/bad/eagle3}}",
                                                     f"eval.out={S}/out/e"], "eagle3"),
        ("a speculators folder to calibrate", ["calibrate", "{R}", f"drafter.path={S}/spec/full",
                                               f"calibrate.out={S}/out/c"], "does not decode alone"),
        ("a speculators folder in dllm eval", ["eval", "{R}", f"drafter.path={S}/spec/full", "eval.mode=dllm",
                                               f"eval.out={S}/out/e"], "does not decode alone"),
        ("an align DFlash folder to calibrate", ["calibrate", "{R}", f"drafter.path={S}/dflash/step_1",
                                                 f"calibrate.out={S}/out/c"], "does not decode alone"),
    ]
    for what, argv, expect in formats:
        add(refuse(f"format: {what}", "52", argv, expect,
                   setup=eagle3_folder if "EAGLE" in what else None))

    # --- a user's DeepSpeed JSON (train.deepspeed_config) ----------------------------------------------------------
    ds = [
        ("not JSON", "{zero", "is not JSON"), ("a list", "[1]", "is not a JSON object"),
        ("an optimizer", '{"optimizer": {"type": "Adam"}}', "optimizer is not taken from your file"),
        ("a scheduler", '{"scheduler": {"type": "WarmupLR"}}', "scheduler is not taken"),
        ("train_batch_size", '{"train_batch_size": 64}', "train_batch_size is not taken"),
        ("fp16 on", '{"fp16": {"enabled": true}}', "fp16 is not taken"),
        ("a micro-batch size of its own", '{"train_micro_batch_size_per_gpu": 7}', "train.micro_batch_size"),
        ("another ZeRO stage", '{"zero_optimization": {"stage": 3}}', "train.zero_stage"),
        ("ZeRO as a number", '{"zero_optimization": 2}', "zero_optimization"),
        ("bf16 as a plain boolean", '{"bf16": true}', "train.bf16"),
        ("gradient clipping of its own", '{"gradient_clipping": 5.0}', "train.grad_clip"),
        ("accumulation steps as a string", '{"gradient_accumulation_steps": "1"}', "gradient_accumulation_steps"),
        # align/deepspeed_json.py (check_deepspeed_json): DeepSpeed's types, its keys, the offloads the stage runs
        ("steps_per_print a string", '{"steps_per_print": "often"}',
         "steps_per_print: Input should be a valid integer"),
        ("an unknown key", '{"zero_optimisation": {"stage": 2}}', "did you mean 'zero_optimization'?"),
        ("NVMe offload without a path", '{"zero_optimization": {"offload_param": {"device": "nvme"}}}',
         "zero_optimization.offload_param: DeepSpeed offloads it only under ZeRO-3"),
        # the base recipe's train.zero_stage is 0: the optimizer offload is what DeepSpeed would drop (fp16
        # communication is a valid DeepSpeed setting, which gloo runs)
        ("a CUDA-only setting on a CPU run", '{"zero_optimization": {"offload_optimizer": {"device": "cpu", '
         '"pin_memory": true}}, "communication_data_type": "fp16"}', "zero_optimization.offload_optimizer"),
    ]
    for what, content, expect in ds:
        add(refuse(f"deepspeed JSON: {what}", "52", ["train", "{R}", f"train.deepspeed_config={S}/bad/ds.json",
                                                     f"train.out={S}/out/r", "train.max_steps=1"], expect,
                   setup=bad("ds.json", content), sub=True))
    add(refuse("deepspeed JSON: a missing file", "52", ["train", "{R}", f"train.deepspeed_config={S}/bad/none.json",
                                                        f"train.out={S}/out/r"], "train.deepspeed_config", sub=True))
    add(refuse("deepspeed JSON: a folder", "52", ["train", "{R}", f"train.deepspeed_config={S}/work",
                                                  f"train.out={S}/out/r"], "train.deepspeed_config", sub=True))

    # --- prompt mixtures (data.train_prompts as a list; align trajectories reads them) ----------------------------
    def mix(*sources: str) -> str:
        return "data.train_prompts=[" + ", ".join(sources) + "]"

    good = f"{{path: {S}/bad/good.jsonl}}"
    # enough prompts for any source's share of trajectories.num_prompts: a short one is refused for that
    prompts_file = bad("good.jsonl", "".join(json.dumps({"prompt": f"def f{i}(a, b):"}) + "\n" for i in range(48)))
    mixtures = [
        ("a weight of 0", mix(good, f"{{path: {S}/bad/good.jsonl, weight: 0}}"), "weight"),
        ("a negative weight", mix(f"{{path: {S}/bad/good.jsonl, weight: -1}}"), "weight"),
        ("a weight as text", mix(f"{{path: {S}/bad/good.jsonl, weight: heavy}}"), "weight"),
        ("an infinite weight", mix(f"{{path: {S}/bad/good.jsonl, weight: .inf}}"), "weight"),
        ("a source without a path", mix("{weight: 1}"), "path"),
        ("an unknown key in a source", mix(f"{{path: {S}/bad/good.jsonl, wieght: 2}}"), "wieght"),
        ("a missing file", mix(good, f"{{path: {S}/bad/none.jsonl}}"), "none.jsonl"),
        ("an empty file", mix(good, f"{{path: {S}/bad/empty.jsonl}}"), "empty.jsonl"),
        ("a file without the prompt column", mix(good, f"{{path: {S}/bad/other.jsonl}}"), "prompt"),
        ("a prompt_column that is not there", mix(f"{{path: {S}/bad/good.jsonl, prompt_column: question}}"),
         "question"),
        ("a column of numbers", mix(good, f"{{path: {S}/bad/numbers.jsonl}}"), "numbers.jsonl"),
        ("a torn JSONL line", mix(good, f"{{path: {S}/bad/torn.jsonl}}"), "torn.jsonl"),
        ("a Hub id offline", mix(good, "{path: nobody/no-such-prompts}"), "nobody/no-such-prompts"),
        ("an empty mixture", "data.train_prompts=[]", "data.train_prompts"),
        ("a folder that is no dataset", mix(good, f"{{path: {S}/work}}"), "work"),
    ]
    files = {"empty.jsonl": "", "other.jsonl": '{"question": "why?"}\n', "numbers.jsonl": '{"prompt": 5}\n',
             "torn.jsonl": '{"prompt": "a"}\n{"prompt": "b'}

    def mixture_files(s: Sandbox) -> None:
        prompts_file(s)
        for name, content in files.items():
            write(s.root / "bad" / name, content)

    for what, override, expect in mixtures:
        add(refuse(f"mixture: {what}", "52", ["trajectories", "{R}", override, f"trajectories.out={S}/out/t"],
                   expect, setup=mixture_files))

    # --- launcher flags passed on to DeepSpeed's runner ------------------------------------------------------------
    hosts = bad("hosts", "node-a slots=1\nnode-b slots=1\n")
    launches = [
        ("--num_nodes 2 without a hostfile", ["--num_nodes", "2"], "--num_nodes 2 needs --hostfile", None),
        ("--num_nodes 3 with a hostfile of 2", ["--hostfile", f"{S}/bad/hosts", "--num_nodes", "3"],
         "names 2 host(s)", hosts),
        ("--node_rank without a hostfile", ["--node_rank", "0"], "--node_rank needs --hostfile", None),
        ("--node_rank past the hosts", ["--hostfile", f"{S}/bad/hosts", "--node_rank", "2"], "--node_rank 2", hosts),
        ("--include with --exclude", ["--include", "localhost:0", "--exclude", "localhost:1"], "do not go together",
         None),
        ("--num_gpus with --include", ["--num_gpus", "2", "--include", "localhost:0"], "do not go together", None),
        ("--include an unknown host", ["--include", "gpu-7"], "gpu-7 is not a host", None),
        ("a hostfile line without slots", ["--hostfile", f"{S}/bad/hosts", "--node_rank", "0"], "slots=N",
         bad("hosts", "node-a 1\n")),
        ("an empty hostfile", ["--hostfile", f"{S}/bad/hosts", "--node_rank", "0"], "names no host", bad("hosts", "")),
        ("a hostfile naming a host twice", ["--hostfile", f"{S}/bad/hosts", "--node_rank", "0"], "a second time",
         bad("hosts", "node-a slots=1\nnode-a slots=1\n")),
    ]
    for stage, out in (("train", "train.out"), ("trajectories", "trajectories.out")):
        for what, flags, expect, setup in launches:
            if stage == "trajectories" and what not in ("--num_nodes 2 without a hostfile",
                                                        "--node_rank without a hostfile", "--include with --exclude"):
                continue
            add(refuse(f"launch {stage}: {what}", "52", [stage, "{R}", *flags, f"{out}={S}/out/l"], expect,
                       setup=setup, sub=True))

    # --- ~ in a path key -------------------------------------------------------------------------------------------
    add(Case("eval.out=~/x is the home's x, not ./~", "52", argv=["validate", "{R}", "eval.out=~/x", "--get",
                                                                   "eval.out"], kind="fault", ci=True,
             check=lambda s, r: ("handled", r.out.strip()) if r.code == 0 and r.out.strip() == os.path.expanduser(
                 "~/x") and not (s.root / "work" / "~").exists() else ("silent", f"exit {r.code}: {r.out.strip()}")))
    return table


# --------------------------------------------------------------------------------------------------------------------
# running the table
# --------------------------------------------------------------------------------------------------------------------
def select(table: list[Case], sandbox: Sandbox, ci: bool = False, findings: Optional[set[str]] = None,
           contains: Optional[str] = None) -> list[Case]:
    return [c for c in table if (not ci or c.ci) and set(c.needs) <= sandbox.has
            and (findings is None or c.finding in findings) and (contains is None or contains in c.name)]


def run_table(chosen: list[Case], sandbox: Sandbox, show: bool = True) -> list[tuple[Case, str, str, float]]:
    if any(c.api is not None for c in chosen):
        with captured():  # the API's pairs, loaded before any case counts the models built
            for kind in ("pair", "chat", "dflash"):
                _pair(sandbox, kind)
    unwatch = watch_models()
    rows = []
    try:
        for i, case in enumerate(chosen):
            kind, detail, seconds = probe(case, sandbox)
            rows.append((case, kind, detail, seconds))
            if show:
                print(f"[{i + 1}/{len(chosen)}] {kind:9} {case.finding:>2} {case.name}  ({seconds:.1f} s)",
                      file=sys.stderr, flush=True)
    finally:
        unwatch()
    return rows


def report(rows: list[tuple[Case, str, str, float]]) -> str:
    counts = {k: sum(kind == k for _, kind, _, _ in rows) for k in CLASSES}
    lines = ["| # | finding | case | class | what happened |", "|---|---|---|---|---|"]
    for i, (case, kind, detail, _) in enumerate(rows):
        lines.append(f"| {i + 1} | {case.finding} | {case.name} | {kind} | {detail.replace('|', '/')} |")
    lines += ["", f"{len(rows)} cases: " + ", ".join(f"{k} {n}" for k, n in counts.items())]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ci", action="store_true", help="only the fast subset tests/test_probe.py runs")
    parser.add_argument("--finding", default=None, help="comma-separated finding numbers of issue 24 ('-': older)")
    parser.add_argument("-k", dest="contains", default=None, help="only cases whose name holds this text")
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    parser.add_argument("--family", default=None, metavar="ROOT",
                        help="a toy family already built (the root tests/conftest.py's toy_family makes)")
    parser.add_argument("--strict", action="store_true", help="exit 1 unless every case is clean or handled")
    parser.add_argument("--no-run", action="store_true",
                        help="build no finished training run (the cases that need one are left out)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="align-probe-") as tmp:
        t0 = time.perf_counter()
        sandbox = build(Path(tmp), family=Path(args.family) if args.family else None, full=not (args.ci or args.no_run))
        print(f"sandbox built in {time.perf_counter() - t0:.0f} s: {tmp}", file=sys.stderr)
        chosen = select(cases(), sandbox, args.ci, set(args.finding.split(",")) if args.finding else None,
                        args.contains)
        rows = run_table(chosen, sandbox)
    text = report(rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    failed = [f"{case.finding} {case.name}: {kind}: {detail}" for case, kind, detail, _ in rows
              if kind not in ("clean", "handled")]
    if args.strict and failed:
        print("not clean or handled:\n" + "\n".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
