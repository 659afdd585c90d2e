"""Provenance: where an exported model and its data came from, said without any path of the machine that exported
them. A model that came from the Hub is named by its id, a local one by its manifest (what built it, its hashes), a
local file by its name and sha256, and paths in the run records are cut to what a reader can use (`scrub`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from align.hub import hub_snapshot, is_hub_id

# --------------------------------------------------------------------------------------------------------------------
# where the models and data came from, as a card may say it (never a path of this machine)
# --------------------------------------------------------------------------------------------------------------------
HUB = "https://huggingface.co"


# A Hub cache snapshot (HF_HUB_CACHE/models--org--name/snapshots/<commit>): the folder of a model loaded by id.
_SNAPSHOT = re.compile(r"(?:^|/)(models|datasets)--([^/]+?)--([^/]+)/snapshots/[^/]+")


@dataclass(frozen=True)
class Origin:
    """A model as the card names it: `hub_id` when it came from the Hub; otherwise `name` (its manifest's part, or its
    folder's basename) and `described` (what its manifest says built it). `folder`: its files on this machine (a
    local folder or a Hub cache snapshot), only to read its licence; never written anywhere."""

    hub_id: Optional[str]
    name: str
    described: str
    folder: Optional[Path]

    @property
    def short(self) -> str:
        return self.hub_id.split("/")[-1] if self.hub_id else self.name

    def markdown(self) -> str:
        """A short mention: a link to its Hub page, or its name (`described` says the rest, once per card)."""
        return f"[{self.hub_id}]({HUB}/{self.hub_id})" if self.hub_id else f"`{self.name}`"


def snapshot_hub_id(path: str) -> Optional[str]:
    m = _SNAPSHOT.search(Path(path).as_posix())
    return f"{m.group(2)}/{m.group(3)}" if m else None


def origin(path: str) -> Origin:
    """Who `path` (a model's recipe path: a local folder or a Hub id) is. A local folder built by align is cited by
    its manifest.json (the command and recipe that built it, the hashes of its settings and corpus) and, when that
    manifest records one, by the Hub id it came from."""
    local = Path(path)
    if not local.is_dir():
        if is_hub_id(path):
            return Origin(path, path, f"[{path}]({HUB}/{path})", hub_snapshot(path))
        return Origin(None, local.name or path, f"`{local.name or path}`", None)
    hub_id = snapshot_hub_id(str(local.resolve()))
    manifest = {}
    if (local / "manifest.json").is_file():
        try:
            manifest = json.loads((local / "manifest.json").read_text())
        except ValueError:
            manifest = {}
    hub_id = hub_id or next((manifest[k] for k in ("hub_id", "base_model", "source") if isinstance(manifest.get(k), str)
                             and is_hub_id(manifest[k])), None)
    name = str(manifest.get("part") or local.resolve().name)
    if hub_id:
        return Origin(hub_id, name, f"[{hub_id}]({HUB}/{hub_id})", local)
    if manifest:
        facts = [f"built by `{scrub_text(manifest['command'])}`" if manifest.get("command") else "",
                 f"recipe `{manifest['recipe']}`" if manifest.get("recipe") else "",
                 *(f"{label} `{manifest[key]}`" for key, label in
                   (("config_hash", "settings hash"), ("corpus_hash", "corpus sha256"))
                   if manifest.get(key)),
                 f"{manifest['parameters']:,} parameters" if isinstance(manifest.get("parameters"), int) else ""]
        described = f"`{name}`, a local model ({', '.join(f for f in facts if f)}; from its manifest.json)"
    else:
        architectures = _architectures(local)
        described = f"`{name}`, a local model" + (f" ({architectures})" if architectures else "") + " with no manifest"
    return Origin(None, name, described, local)


def _architectures(folder: Path) -> str:
    try:
        return ", ".join(json.loads((folder / "config.json").read_text()).get("architectures") or [])
    except (OSError, ValueError):
        return ""


# --------------------------------------------------------------------------------------------------------------------
# no paths of this machine in the folder
# --------------------------------------------------------------------------------------------------------------------
# An absolute path of two or more parts (POSIX, home-relative or a Windows drive), not inside a URL, an org/name id
# or markup: `/tmp/run/ck` is one, `</s>`, `/no_think`, `https://huggingface.co/org/name` and `tokens/s` are not.
_PART = r"[^\s'\"`,;=()\[\]{}<>|*/\\]+"


_ABSOLUTE = re.compile(rf"(?<![\w.:/~<\\-])((?:~|[A-Za-z]:)?[/\\]{_PART}(?:[/\\]{_PART})+[/\\]?)")


# Tokenizer data and chat templates hold vocabulary and markup, never paths, and must stay byte for byte.
_VERBATIM_FILES = {"tokenizer.json", "vocab.json", "merges.txt", "added_tokens.json"}


_VERBATIM_KEYS = {"chat_template", "added_tokens_decoder", "vocab", "merges"}


# Keys that only say how this machine loaded a file: transformers reads them back, and `local_files_only: true`
# would stop a tokenizer downloaded from the Hub from fetching anything.
_MACHINE_KEYS = {"_name_or_path", "name_or_path", "local_files_only", "is_local", "_commit_hash"}


def path_identity(path: str) -> str:
    """What a reader may see of a path of this machine: a Hub cache snapshot's id, a path relative to the working
    folder (the align checkout, where recipes name checkpoints/ and data/), or the basename."""
    hub_id = snapshot_hub_id(path)
    if hub_id:
        return hub_id
    expanded = Path(os.path.expanduser(path))
    basename = re.split(r"[/\\]", path.rstrip("/\\"))[-1] or "."  # a Windows path's parts too
    if not expanded.is_absolute():
        return basename
    try:
        return expanded.resolve().relative_to(Path.cwd().resolve()).as_posix() or "."
    except (ValueError, OSError):
        return basename


def scrub_text(text: str) -> str:
    return _ABSOLUTE.sub(lambda m: path_identity(m.group(1)), text)


def scrub(value: Any) -> Any:
    """`value` (JSON-like) with every path of this machine cut to `path_identity`."""
    if isinstance(value, str):
        return scrub_text(value)
    if isinstance(value, dict):
        return {k: v if k in _VERBATIM_KEYS else scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v) for v in value]
    return value


def scrub_folder(folder: Path) -> None:
    """Rewrite the folder's JSON, YAML and text files without this machine's paths (code is left as written)."""
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or path.name in _VERBATIM_FILES:
            continue
        if path.suffix == ".json":
            data = json.loads(path.read_text())
            clean = scrub(data)
            if isinstance(clean, dict):  # a model's or tokenizer's own config: its loading hints go
                clean = {k: v for k, v in clean.items() if k not in _MACHINE_KEYS}
            if clean != data:
                path.write_text(json.dumps(clean, indent=2, ensure_ascii=False) + "\n")
        elif path.suffix in (".yaml", ".yml", ".md", ".txt"):
            text = path.read_text()
            if scrub_text(text) != text:
                path.write_text(scrub_text(text))


def installed_versions(*names: str) -> dict[str, Optional[str]]:
    """The installed version of each distribution named, None for one that is not installed: what a stage's manifest
    records of the software that wrote it."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, Optional[str]] = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found
