"""Everything that puts a file or a folder in place, and the merged-weights checkpoint format.

A reader (a resuming run, a later stage, a user) must never see a half-written file or folder, and a crash must never
leave *less* than there was before: so every write goes to a temporary name beside its target and is renamed into
place once complete, and a folder being replaced survives until its successor is in place. This module is the only
place in align that renames into place (a test checks it).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

STEP_FOLDER = re.compile(r"^step_(\d+)$")


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


def publish_folder(tmp: Path, final: Path) -> None:
    """Replace `final` by the finished `tmp` folder; the old `final` is kept (as `<final>.old`) until the new one is in
    place, so a crash at any moment leaves the old folder or the new one, never neither."""
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_folder(final: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary folder beside `final`; when the block ends without an error it is published as
    `final` (publish_folder). On an error the temporary folder is removed and `final` is left as it was."""
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_folder(tmp, final)


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


def save_merged(model: Any, tokenizer: Any, final: Path, files: dict[str, str]) -> None:
    """Write `model` (merged, in its own dtype) and `tokenizer` as an HF folder at `final`, with extra text `files`
    (name -> content, e.g. meta.json), atomically."""
    _tied_keys_as_mapping(model)
    with atomic_folder(final) as tmp:
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
