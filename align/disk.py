"""Nothing is lost: everything that puts a file or a folder in place, what align may overwrite, locks, disk faults,
checksums and appended logs. (The checkpoint formats are align/checkpoint.py.)

A reader (a resuming run, a later stage, a user) must never see a half-written file or folder, and a crash must never
leave *less* than there was before: so every write goes to a temporary name beside its target and is renamed into
place once complete, and a folder being replaced survives until its successor is in place. This module is the only
place in align that renames into place (a test checks it).

It is also where align decides what it may overwrite. Every folder a stage writes carries a marker (`.align`, naming
the stage's recipe section), and a stage writes only into a folder that is new, empty, or already its own; it replaces
a folder whole only when that folder holds nothing but an earlier output of the same kind. And a folder a run is
writing is locked (`fcntl.flock`, released by the kernel when the process dies), so that a second run into it is
refused instead of interleaving with the first.

What it publishes is also checked when read back: a folder carries `sha256.json` (each file's sha256, computed once
at save), and readers verify it (`verify_checksums`), so that a bit flip or a cut copy is named instead of loaded.
A write that fails for want of space or rights comes out as an OSError naming its path (`naming_path`), which the
CLI says in one line.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

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
# In a folder align wrote: relative file name -> sha256 of every other file in it (meta.json included).
CHECKSUMS = "sha256.json"
# Recorded but not checked: the settings a user edits on purpose (a longer context, a fixed chat template). Their
# damage cannot pass unseen (they are parsed and validated where read); weights, states and tokenizers' vocabularies
# could change silently, so those are checked.
EDITABLE_FILES = frozenset({"config.json", "generation_config.json", "tokenizer_config.json", "chat_template.jinja"})
# Why a write fails that the user must fix outside align (free space, a quota, a read-only or forbidden folder), or
# that the disk itself reports: said as one line naming the path, never as a traceback.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO})
# The exit status of a run stopped by such a write (cli.py lists them all; 2 is bad input).
EXIT_DISK_FAULT = 1
# Writers with their own I/O lose the errno: safetensors' Rust writer keeps it in its message ("(os error 28)"),
# torch's zip writer says only that its position went wrong.
_OS_ERROR_IN_MESSAGE = re.compile(r"(?:os error|errno) (\d+)", re.IGNORECASE)
_TORCH_WRITE_FAILED = ("unexpected pos", "file write failed", "PytorchStreamWriter failed")


def through_links(path: str | os.PathLike) -> Path:
    """`path`, or, when it is a symbolic link, what it points to: an atomic write renames a new file or folder into
    place, which would replace the link itself with a real one and leave its target stale (a symlinked export.out)."""
    path = Path(path)
    return path.resolve() if path.is_symlink() else path


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path` (beside its target, for a link); when the block ends without an error it
    replaces `path` in one rename.

    The temporary name carries the pid, so ranks that write the same file at once do not collide."""
    path = through_links(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with naming_path(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            yield tmp
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def set_aside(path: str | os.PathLike, name: str) -> Path:
    """Rename `path` to `name` in its folder (replacing what has that name) and return the new path: a file a stage
    will not use but must not lose (a damaged resume state, or one of other settings)."""
    path = Path(path)
    aside = path.with_name(name)
    os.replace(path, aside)
    return aside


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text)


def write_result(path: str | os.PathLike, text: str) -> None:
    """write_text_atomic for a result that took long to make (eval.json): when the disk refuses it, the text is
    kept in the system's temporary folder (often another disk) and the error (`kept`) names that copy, so that a
    full disk costs a copy, not a rerun."""
    try:
        write_text_atomic(path, text)
    except OSError as error:
        if disk_errno(error) is None:
            raise
        fd, kept = tempfile.mkstemp(prefix=f"align-{Path(path).stem}-", suffix=Path(path).suffix)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            error.kept = kept  # type: ignore[attr-defined]  (said by disk_fault)
        except OSError:  # that disk is full too: nothing more to do
            Path(kept).unlink(missing_ok=True)
        raise


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


def discard_folder(folder: Path) -> None:
    """Delete `folder` so that no reader ever finds it half deleted: one rename takes it out of sight (to a name
    align's own temporary files have, ALIGN_TEMPORARY), then it is removed."""
    doomed = folder.with_name(f".{folder.name}.discarded.old")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(folder, doomed)
    shutil.rmtree(doomed)


@contextmanager
def atomic_folder(final: str | os.PathLike, kind: str) -> Iterator[Path]:
    """Yield an empty temporary folder beside `final` (beside its target, for a link); when the block ends without an
    error it is marked as `kind`'s output and published as `final` (publish_folder). On an error the temporary folder
    is removed and `final` is left as it was."""
    final = through_links(final)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with naming_path(final):
            tmp.mkdir(parents=True)
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


# --------------------------------------------------------------------------------------------------------------------
# disk faults
# --------------------------------------------------------------------------------------------------------------------
def disk_errno(error: BaseException) -> Optional[int]:
    """The errno of a write that failed for want of space or rights (DISK_ERRNOS), whichever writer raised it; None
    for every other error."""
    if isinstance(error, OSError):
        return error.errno if error.errno in DISK_ERRNOS else None
    text = str(error)
    found = _OS_ERROR_IN_MESSAGE.search(text)
    if found and int(found.group(1)) in DISK_ERRNOS:
        return int(found.group(1))
    if isinstance(error, RuntimeError) and any(s in text for s in _TORCH_WRITE_FAILED):
        return errno.EIO  # torch keeps no errno; naming the path is what matters (disk_fault says how full it is)
    return None


@contextmanager
def naming_path(path: str | os.PathLike) -> Iterator[None]:
    """Re-raise a failed write under `path` (DISK_ERRNOS, from any writer) as an OSError naming `path`, the one
    thing the user needs to act on; other errors pass unchanged. A write that fails at `f.write` or in a library's
    own writer names no file at all."""
    try:
        yield
    except Exception as error:
        code = disk_errno(error)
        if code is None or (isinstance(error, OSError) and error.filename):
            raise
        if code == errno.EIO and _nearly_full(Path(path)):
            code = errno.ENOSPC  # torch's zip writer, out of room
        raise OSError(code, os.strerror(code), str(path)) from error


def _nearly_full(path: Path) -> bool:
    folder = next((p for p in (path, *path.parents) if p.exists()), None)
    return folder is not None and shutil.disk_usage(folder).free < 1 << 20


def disk_fault(error: BaseException) -> Optional[str]:
    """The one line for a write that failed for want of space or rights ("<path>: No space left on device (…)"), or
    None when `error` is not one."""
    code = disk_errno(error)
    if code is None:
        return None
    where = Path(error.filename) if isinstance(error, OSError) and error.filename else None
    line = f"{where or 'an output'}: {os.strerror(code)}"
    folder = next((p for p in ([where, *where.parents] if where else []) if p.exists()), None)
    if folder is not None and code in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
        free = shutil.disk_usage(folder).free
        line += f" ({free / 2**20:,.1f} MiB free there)"
    fix = {errno.EROFS: "choose a writable folder", errno.EACCES: "choose a folder you may write",
           errno.EPERM: "choose a folder you may write"}.get(code, "free space there and rerun the same command")
    kept = getattr(error, "kept", None)
    if kept:
        return f"{line}; the result is kept in {kept}: copy it there once there is room (no need to rerun)"
    return f"{line}; {fix} (what was already written is intact)"


# --------------------------------------------------------------------------------------------------------------------
# checksums
# --------------------------------------------------------------------------------------------------------------------
# $ALIGN_HASH_LOG, a folder: each process appends a JSON line per file it hashes (how: "read" back from disk, or
# "written" as it was written; bytes; path; RANK), so that what a multi-node run hashes where can be seen and counted.
HASH_LOG = "ALIGN_HASH_LOG"


def _log_hash(how: str, path: Path, nbytes: int) -> None:
    folder = os.environ.get(HASH_LOG)
    if folder:
        record = {"how": how, "bytes": nbytes, "path": str(Path(path).resolve()), "rank": os.environ.get("RANK"),
                  "pid": os.getpid()}
        with open(Path(folder) / f"{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read back from disk (in chunks: weights can be large)."""
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    _log_hash("read", path, path.stat().st_size)
    return digest


# Set by align's launcher for the ranks it starts: its own check of the recipe, before launching, has already read
# and hashed the files the ranks' checks would hash again (a resume's DeepSpeed state, the weights the run started
# from, precomputed verifier states), on the filesystem the ranks read (item 2 of issue 51: shared by the nodes).
CHECKED_BY_LAUNCHER = "ALIGN_CHECKED_BY_LAUNCHER"


def hashes_inputs() -> bool:
    """Whether this process checks the files a stage reads against their recorded digests: the process that checks
    before launching; under a launcher that checked nothing (deepspeed started by hand), local rank 0 of each machine.
    Never every rank: 16 ranks each hashing a 410 GB DeepSpeed state before step 1 would read 6.5 TB."""
    if "LOCAL_RANK" not in os.environ:  # no launcher started this process (launch.launched_by_a_launcher)
        return True
    if os.environ.get(CHECKED_BY_LAUNCHER):
        return False
    return int(os.environ.get("LOCAL_RANK", 0)) == 0


def unchanged_file_sha256(path: Path) -> str:
    """file_sha256, hashed once per process and state of the file (its size and time): a file two checks read (the
    weights a folder's record lists and a run records) is read once."""
    return _digest_of_state(Path(path).resolve(), *_stat(Path(path)))


@functools.lru_cache(maxsize=None)
def _digest_of_state(path: Path, size: int, mtime_ns: int) -> str:
    return file_sha256(path)


class HashingWriter:
    """A binary file opened for writing whose sha256 is taken from the bytes as they pass (`write`), for writers that
    take a file object (torch.save): the digest a record keeps then costs no second read of a file that may be tens
    of gigabytes. `hexdigest()` once closed."""

    def __init__(self, path: Path) -> None:
        self.path, self._file, self._digest, self.bytes = Path(path), Path(path).open("wb"), hashlib.sha256(), 0

    @property
    def name(self) -> str:  # as a file object's: writers and their wrappers name the file by it
        return str(self.path)

    def write(self, data: "memoryview | bytes") -> int:
        self._digest.update(data)
        self.bytes += memoryview(data).nbytes
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
            _log_hash("written", self.path, self.bytes)

    def __enter__(self) -> "HashingWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def write_hashed(path: Path, data: "memoryview | bytes", piece: int = 64 * 2**20) -> str:
    """Write `data` to `path` and return its sha256, hashed as it is written (piece by piece, from the bytes in memory)."""
    view = memoryview(data).cast("B")
    with HashingWriter(path) as f:
        for start in range(0, len(view), piece):
            f.write(view[start : start + piece])
    return f.hexdigest()


def record_checksums(folder: str | os.PathLike, names: Optional[Iterable[str]] = None,
                     known: Optional[dict[str, str]] = None) -> None:
    """Write `folder`/sha256.json: every file's sha256 (relative names), or, given `names`, those files' entries
    updated in the existing record (a file rewritten after the save, such as meta.json; a folder without a record,
    saved before align recorded them, keeps none). `known`: digests taken as files were written (relative name ->
    sha256), kept as they are; only the other files are read back."""
    folder = Path(folder)
    if names is None:
        files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        record = {}
    else:
        files, record = list(names), read_checksums(folder)
        if record is None:
            return
    known = known or {}
    record.update({name: known[name] if name in known else file_sha256(folder / name)
                   for name in files if name != CHECKSUMS})
    write_text_atomic(folder / CHECKSUMS, json.dumps(dict(sorted(record.items())), indent=1))


def read_checksums(folder: str | os.PathLike) -> Optional[dict[str, str]]:
    """The folder's recorded checksums; None when it has none (written before align recorded them, or not by
    align). An unreadable record is corruption like any other."""
    path = Path(folder) / CHECKSUMS
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if isinstance(record, dict) and all(isinstance(v, str) for v in record.values()):
            return record
    except ValueError:
        pass
    raise RecipeError(f"{path} is not a readable checksum record (corrupted): restore the folder or write it again")


def verify_checksums(folder: str | os.PathLike, key: str = "") -> bool:
    """Check every file `folder`/sha256.json lists against it (but EDITABLE_FILES); False when there is no record.
    Raises RecipeError naming the first missing or differing file. Hashing is the cost of reading the files once
    (well under a second for the tiny family); a folder already verified in this process is not hashed again."""
    folder = Path(folder).resolve()
    record = read_checksums(folder)
    if record is None:
        return False
    record = {name: digest for name, digest in record.items() if Path(name).name not in EDITABLE_FILES}
    stats = tuple((name, *_stat(folder / name)) for name in sorted(record))
    problem = _first_mismatch(folder, json.dumps(record, sort_keys=True), stats)
    if problem:
        raise RecipeError(f"{key + ': ' if key else ''}{problem}: restore the folder or write it again (or, if "
                          f"the file was changed on purpose, delete {CHECKSUMS})")
    return True


def _stat(path: Path) -> tuple[int, int]:
    try:
        s = path.stat()
        return s.st_size, s.st_mtime_ns
    except OSError:
        return -1, -1


@functools.lru_cache(maxsize=64)
def _first_mismatch(folder: Path, record_json: str, stats: tuple[tuple[str, int, int], ...]) -> Optional[str]:
    """What is wrong with the first file that differs from its record, or None. Cached on the files' sizes and
    times: a file changed since its last check is hashed again."""
    for name, digest in json.loads(record_json).items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing (listed in {folder / CHECKSUMS})"
        if unchanged_file_sha256(path) != digest:
            return f"{path} is corrupted (its sha256 differs from the one in {folder / CHECKSUMS})"
    return None


def non_finite_weights(folder: str | os.PathLike) -> Optional[str]:
    """'<file>: <tensor>' of the first NaN or infinite weight in a folder's safetensors files, or None. Read a tensor
    at a time, so that the check needs no more memory than the largest tensor."""
    import torch
    from safetensors import safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    return f"{path}: {name}"
    return None


# --------------------------------------------------------------------------------------------------------------------
# appended logs (metrics.jsonl): one JSON record a line
# --------------------------------------------------------------------------------------------------------------------
def read_log(path: str | os.PathLike, who: str = "align") -> list[dict[str, Any]]:
    """The records of a JSON-lines log. A cut last line (a crash or a full disk mid-append) is dropped with a
    warning: the record it held is lost, nothing else. A line that does not parse anywhere else was damaged after
    it was written: RecipeError naming the file and the line."""
    path = Path(path)
    lines = path.read_text(errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a record")
        except ValueError:
            if number == len(lines):
                print(f"{who}: warning: {path}: line {number} was cut short mid-write (a crash or a full disk); "
                      "dropped it", file=sys.stderr)
                break
            raise RecipeError(f"{path}: line {number} is not a JSON record (the file is damaged): repair or delete "
                              "that line") from None
        records.append(record)
    return records


def _is_record(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def append_log(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one record as a line. A cut last line left by an earlier crash is cut off first, so that the file
    stays one record a line (otherwise the new record would be glued to the fragment)."""
    path = Path(path)
    with naming_path(path), path.open("a+b") as f:
        end = f.seek(0, os.SEEK_END)
        f.seek(max(0, end - (1 << 16)))  # lines are far shorter: the last one is in the file's last 64 KiB
        tail = f.read()
        if tail and not tail.endswith(b"\n"):
            fragment = tail.rsplit(b"\n", 1)[-1]
            if _is_record(fragment):
                f.write(b"\n")  # a whole record, only its newline missing (written by hand)
            else:
                f.truncate(end - len(fragment))
        f.write((json.dumps(record) + "\n").encode())
