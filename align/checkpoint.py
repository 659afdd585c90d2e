"""Everything that puts a file or a folder in place, and the merged-weights checkpoint format.

A reader (a resuming run, a later stage, a user) must never see a half-written file or folder, and a crash must never
leave *less* than there was before: so every write goes to a temporary name beside its target and is renamed into
place once complete, and a folder being replaced survives until its successor is in place. This module is the only
place in align that renames into place (a test checks it).

It is also where align decides what it may overwrite. Every folder a stage writes carries a marker (`.align`, naming
the stage's recipe section), and a stage writes only into a folder that is new, empty, or already its own; it replaces
a folder whole only when that folder holds nothing but an earlier output of the same kind. And a folder a run is
writing is locked (`fcntl.flock`, released by the kernel when the process dies), so that a second run into it is
refused instead of interleaving with the first.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from align.config import RecipeError

STEP_FOLDER = re.compile(r"^step_(\d+)$")
# The marker file in every folder align writes: {"written_by": <recipe section of the stage's output key>, "align": ...}
MARKER = ".align"
# What align leaves beside or inside a folder while it works on it (temporary twins, the replaced folder, locks): never
# the user's, so they neither make a folder "not empty" nor block its replacement.
ALIGN_TEMPORARY = re.compile(r"^\.(.+\.(tmp|old|lock)|align)$")
# Folders align wrote before it marked them: a file each kind always held, and a key of that JSON file (None: the file
# or folder alone). Only these count as align's without a marker.
UNMARKED_SIGNS: tuple[tuple[str, str, Optional[str]], ...] = (
    ("bootstrap", "tokenizer/manifest.json", "part"),  # bootstrap.out
    ("bootstrap", "manifest.json", "part"),  # one of its parts (the shipped checkpoints/tiny/*), before data's: a
    ("data", "manifest.json", "corpus_hash"),  # part's manifest names its corpus too; data.dir's has no part
    ("data", "trigram.npz", None),  # a CPS proxy cached under data.dir/trigram
    ("trajectories", "manifest.json", "settings_hash"),
    ("trajectories", "chunk.json", "settings"),  # one chunk
    ("trajectories", "chunks", None),  # a run killed before its manifest
    ("train", "metrics.jsonl", None), ("train", "ds_state", None),
    ("train", "meta.json", "step"),  # a step_<N> checkpoint
    ("gkd", "final/meta.json", "log"), ("gkd", "meta.json", "log"),
    ("eval", "eval.json", "methods"),
    ("calibrate", "draft_graph.json", "nodes"),
    ("serve_check", "serve_check.json", "check"),
)
# Set by the align process that holds folders' locks, for the ranks it launches (they inherit its environment): JSON,
# lock file -> the holder's pid.
HELD_LOCKS = "ALIGN_HELD_LOCKS"


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block ends without an error it replaces `path` in one rename.

    The temporary name carries the pid, so ranks that write the same file at once do not collide."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text)


def publish_folder(tmp: Path, final: Path, kind: str) -> None:
    """Replace `final` by the finished `tmp` folder; the old `final` is kept (as `.<final>.old`) until the new one is
    in place, so a crash at any moment leaves the old folder or the new one, never neither. `final` must be missing,
    empty or an earlier output of the same `kind` (check_output_owner, replaced=True): what is there is deleted."""
    check_output_owner(f"{kind} output", final, kind, replaced=True)
    old = final.with_name(f".{final.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_folder(final: str | os.PathLike, kind: str) -> Iterator[Path]:
    """Yield an empty temporary folder beside `final`; when the block ends without an error it is marked as `kind`'s
    output and published as `final` (publish_folder). On an error the temporary folder is removed and `final` is left
    as it was."""
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        # Last, so that a marker copied in with the contents (an export copies a step folder) is replaced.
        (tmp / MARKER).write_text(_marker_text(kind))
        check_output_owner(f"{kind} output", final, kind, replaced=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_folder(tmp, final, kind)


# --------------------------------------------------------------------------------------------------------------------
# what align may overwrite, and who is writing
# --------------------------------------------------------------------------------------------------------------------
def _marker_text(kind: str) -> str:
    from align import __version__

    return json.dumps({"written_by": kind, "align": __version__}) + "\n"


def _json_key(path: Path, key: Optional[str]) -> bool:
    if key is None:
        return path.exists()
    try:
        content = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(content, dict) and key in content


def folder_kind(folder: str | os.PathLike) -> Optional[str]:
    """Which stage's output `folder` is: the recipe section its marker names (or, unmarked, the kind its files show:
    UNMARKED_SIGNS); "" for a missing or empty folder; None for a folder holding something align did not write."""
    folder = Path(folder)
    if not folder.is_dir() or not any(not ALIGN_TEMPORARY.match(p.name) for p in folder.iterdir()):
        return ""
    try:
        return str(json.loads((folder / MARKER).read_text())["written_by"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return next((kind for kind, name, key in UNMARKED_SIGNS if _json_key(folder / name, key)), None)


def check_output_owner(key: str, folder: str | os.PathLike, kind: str, replaced: bool = False) -> None:
    """Refuse (RecipeError, naming `key`) to write into `folder` unless it is new, empty or already `kind`'s output;
    a folder written into may also hold nothing but other align outputs' folders (data/tiny holding trajectories/).
    `replaced`: the stage deletes the folder and puts its own in its place, so it must hold `kind`'s output only."""
    folder = Path(folder)
    found = folder_kind(folder)
    if found in ("", kind):
        return
    if found is None and not replaced and all(ALIGN_TEMPORARY.match(p.name) or (p.is_dir() and folder_kind(p))
                                              for p in folder.iterdir()):
        return
    whose = f"align did not write it (it has no {MARKER} marker)" if found is None else f"it holds align {found} output"
    raise RecipeError(f"{key}: {folder} is not empty and {whose}, so align will not "
                      f"{'replace' if replaced else 'write into'} it; choose a new or empty folder")


def check_output_file(key: str, path: str | os.PathLike, sign: str) -> None:
    """A file align writes whole (verify-costs --out): refused (RecipeError naming `key`) when it names a folder, an
    existing file that is not align's (a JSON object holding the key `sign`), or a place it cannot be created."""
    path = Path(path)
    if path.is_dir():
        raise RecipeError(f"{key}: {path} is a folder; {key} names a JSON file")
    if path.exists() and not _json_key(path, sign):
        raise RecipeError(f"{key}: {path} exists and is not a file align wrote (a JSON object with {sign!r}), so align "
                          "will not replace it; choose a new file")
    existing = path.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise RecipeError(f"{key}: {path} cannot be created ({existing} is not a writable folder)")


def mark_folder(folder: str | os.PathLike, kind: str) -> Path:
    """Create `folder` (after its stage's checks passed) and mark it as `kind`'s output; returns it."""
    folder = Path(folder)
    check_output_owner(f"{kind} output", folder, kind)  # a second look, right before the first write
    folder.mkdir(parents=True, exist_ok=True)
    if folder_kind(folder) != kind or not (folder / MARKER).is_file():
        write_text_atomic(folder / MARKER, _marker_text(kind))
    return folder


def _lock_path(folder: Path) -> Path:
    """The lock file of `folder`: beside it (a folder replaced whole takes its lock along otherwise), or inside it
    when its parent cannot be written (a folder made for the user in a read-only place)."""
    folder = folder.resolve()
    if folder.is_dir() and not os.access(folder.parent, os.W_OK):
        return folder / ".align.lock"
    return folder.parent / f".{folder.name}.lock"


def _held_by_launcher(lock: Path) -> bool:
    """Whether the align process that launched this one holds `lock` for it. An entry of this very process means a
    second run inside the first (an in-process call), which must be refused like any other."""
    try:
        held = json.loads(os.environ.get(HELD_LOCKS, "{}"))
    except ValueError:
        return False
    return isinstance(held, dict) and held.get(str(lock)) not in (None, os.getpid())


@contextmanager
def folder_lock(key: str, folder: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on `folder` for the block, or refuse (RecipeError naming `key`) when another run holds
    it. flock is released by the kernel when its process dies, so a killed run's lock file never blocks the next.

    A run on several ranks is locked once: by the align process that launched them (the ranks find its lock in
    HELD_LOCKS, inherited with its environment), else (deepspeed launched by hand, ranks on other hosts) by rank 0."""
    lock = _lock_path(Path(folder))
    if int(os.environ.get("RANK", 0)) != 0 or _held_by_launcher(lock):
        yield
        return
    # The lock sits beside the folder, whose parents may not exist yet: those made for it go again with the lock, so a
    # stage that refuses after taking it leaves nothing behind.
    made = [p for p in (lock.parent, *lock.parent.parents) if not p.exists()]
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RecipeError(f"{key}: {folder} is in use by another align run ({holder}); wait for it to end, or "
                              "choose another folder") from None
        # Its last holder may have removed the file between our open and our lock: this lock would then guard a name
        # no one else sees. Take the file that is there now.
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()}".encode())
    before = os.environ.get(HELD_LOCKS)
    try:
        held = json.loads(before or "{}")
    except ValueError:
        held = {}
    os.environ[HELD_LOCKS] = json.dumps({**held, str(lock): os.getpid()})
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(HELD_LOCKS, None)
        else:
            os.environ[HELD_LOCKS] = before
        lock.unlink(missing_ok=True)  # before the lock is released: a waiter then finds another file and retries
        os.close(fd)
        for parent in made:  # deepest first; one the stage has written into is not empty and stays
            try:
                parent.rmdir()
            except OSError:
                break


def step_folders(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, folder) of every complete `step_<N>` checkpoint under run_dir, in step order."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := STEP_FOLDER.match(p.name))]
    return sorted(found)


def latest_step(run_dir: str | os.PathLike) -> Optional[Path]:
    """The highest `step_<N>` checkpoint folder under run_dir, or None."""
    folders = step_folders(run_dir)
    return folders[-1][1] if folders else None


def merged_model(module: Any, state: dict[str, Any]) -> Any:
    """A fresh copy of the drafter `module` (a plain model or a peft model) holding `state`, with any LoRA merged into
    the base weights: what users load with transformers alone. It keeps the dtype of `state` (the run's)."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    # The drafter's own class, not an Auto lookup: Dream/DiffuCoder-style remote-code models register AutoModel only,
    # and AutoModelForCausalLM.from_config cannot build them.
    model = type(base)._from_config(base.config)
    if hasattr(module, "peft_config"):
        from peft import get_peft_model

        model = get_peft_model(model, module.peft_config["default"])
        model.load_state_dict(state)
        model = model.merge_and_unload()
    else:
        model.load_state_dict(state)
    return model.to(next(v.dtype for v in state.values() if v.is_floating_point()))


def save_merged(model: Any, tokenizer: Any, final: Path, files: dict[str, str], kind: str = "train") -> None:
    """Write `model` (merged, in its own dtype) and `tokenizer` as an HF folder at `final`, with extra text `files`
    (name -> content, e.g. meta.json), atomically, as `kind`'s output (a training checkpoint unless said)."""
    _tied_keys_as_mapping(model)
    with atomic_folder(final, kind) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for name, text in files.items():
            (tmp / name).write_text(text)


def _tied_keys_as_mapping(model: Any) -> None:
    """Remote code written for transformers 4 (Dream, DiffuCoder: `_tied_weights_keys = ["lm_head.weight"]`) lists
    its tied weights, where transformers 5's save_pretrained reads a {tied: source} mapping and fails on a list.
    Untied models (the configs' `tie_word_embeddings: false`) tie nothing, so the mapping is empty; a tied one maps
    each listed key to the input embedding."""
    listed = [m for m in model.modules() if isinstance(getattr(m, "_tied_weights_keys", None), (list, tuple))]
    if not listed:
        return  # transformers 5 models, and models without input embeddings of their own (DFlash drafters)
    embedding = model.get_input_embeddings()
    source = next((f"{name}.weight" for name, module in model.named_modules() if module is embedding), None)
    tied = getattr(model.config, "tie_word_embeddings", False)
    for module in listed:
        module._tied_weights_keys = {key: source for key in module._tied_weights_keys} if tied and source else {}


# --------------------------------------------------------------------------------------------------------------------
# which model a record names (eval.json's drafters, found again by align export)
# --------------------------------------------------------------------------------------------------------------------
def _file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()  # in chunks: weights can be large


def weights_sha256(folder: Path) -> Optional[str]:
    """The sha256 of a model folder's weights: of its one weights file (what `sha256sum model.safetensors` prints),
    or of the `sha256sum` lines of its shards, sorted by name; None when it holds none."""
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        return None
    if len(files) == 1:
        return _file_sha256(files[0])
    lines = "".join(f"{_file_sha256(f)}  {f.name}\n" for f in files)
    return hashlib.sha256(lines.encode()).hexdigest()


def drafter_identity(path: str) -> dict[str, Any]:
    """How eval.json names a drafter so that it is found again from any folder: `path` as given, `resolved` (the
    absolute folder, or the Hub id) and `weights_sha256` (of the local folder or the Hub cache's snapshot; None when
    neither is on this machine). A relative path alone would be read against whatever folder export runs in."""
    from align.config import hub_snapshot, is_hub_id

    local = Path(path).expanduser()
    folder = local if local.is_dir() else hub_snapshot(path) if is_hub_id(path) else None
    return {"path": path, "resolved": str(local.resolve()) if local.is_dir() else path,
            "weights_sha256": weights_sha256(folder) if folder is not None else None}
