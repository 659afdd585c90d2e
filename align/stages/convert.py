"""`align convert`: real weights in. A GGUF file (an installed package's, or any) or a transformers model folder
becomes an ordinary verifier folder that every stage loads with `from_pretrained`: model.safetensors, config.json, the
tokenizer with its chat template, generation_config.json, a model card stating the licence, and manifest.json.

A GGUF is dequantised by transformers' own loader (`from_pretrained(folder, gguf_file=...)`). A model loaded that way
refuses `save_pretrained` (it carries a GGUF quantisation config), so a plain model is built from its config without
it and given its state dict: every key matches. The saved folder is then loaded back and its logits compared with the
GGUF-loaded model's on a chat-templated prompt (identical in float32), and a greedy answer to that prompt is recorded.

The folder carries sha256.json, which every reader verifies. Cached: a second run with the same source (by sha256)
and settings finds the folder up to date and does nothing; a file changed since (its sha256 against the manifest's) is
said, and the folder converted again.
Everything that can be refused (a package not installed, a file missing, corrupt or not a GGUF, an output folder that
is not align convert's) is refused by `check`, before any conversion (align/weights.py locates and checks sources).
"""

from __future__ import annotations

import functools
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from align.config import Recipe, RecipeError
from align.config_inputs import ConvertSection
from align.provenance import installed_versions
from align.weights import (Source, assemble, check_gguf_header, check_sha256, hub_license, locate, read_gguf,
                           source_sha256)

MANIFEST = "manifest.json"
# The layout of the folder align convert writes: bumped when it changes, so older folders are converted again.
FORMAT = 1
# What the saved folder is checked on: a chat-templated question with a short, well-known answer.
PROBE = "What is the capital of France?"
PROBE_TOKENS = 24


@dataclass(frozen=True)
class Plan:
    """What a run would do: the source, its identity, and whether the output folder already holds its conversion."""

    source: Source
    sha256: Optional[str]  # None: a parts package not yet assembled
    files: dict[str, str]  # a folder source's files -> sha256
    settings: dict[str, Any]
    cached: bool
    changed: Optional[str] = None  # a file of an earlier conversion in the output folder that is not as it was written


def _read_manifest(out: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _check_out(c: ConvertSection, source: Source) -> None:
    """The output folder is new, empty, or an earlier conversion's: anything else (a model someone put there) is
    never replaced."""
    out = Path(c.out)
    if source.folder is not None and out.exists() and out.resolve() in (source.path.resolve(), source.folder.resolve()):
        raise RecipeError(f"convert.out: {c.out} is the source itself; write the verifier elsewhere")
    if out.is_dir() and any(out.iterdir()) and (_read_manifest(out) or {}).get("stage") != "convert":
        raise RecipeError(f"convert.out: {c.out} holds files that align convert did not write; choose another "
                          "folder or empty it")


def _up_to_date(out: Path, settings: dict[str, Any]) -> tuple[bool, Optional[str]]:
    """Whether `out` holds this conversion with every file as written, by its sha256, not its size (one flipped byte
    in the weights kept the size and was served as up to date); and, when an earlier conversion's file was changed,
    which one."""
    from align.disk import file_sha256

    made = _read_manifest(out)
    if not made or made.get("stage") != "convert" or made.get("settings") != settings:
        return False, None
    for name, f in made["files"].items():
        if not (out / name).is_file() or (out / name).stat().st_size != f["bytes"] or \
                file_sha256(out / name) != f["sha256"]:
            return False, name
    return True, None


def plan(recipe: Recipe, assemble_parts: bool = False) -> Plan:
    """Locate the source, identify it (sha256), check it against what is expected of it, and see whether convert.out
    is already its conversion. A parts package is assembled only when `assemble_parts` (in the stage, not in its
    check). Raises RecipeError."""
    c = recipe.convert
    source = locate(c)
    if source.assembles is not None and assemble_parts:
        source = assemble(source)
    _check_out(c, source)
    if source.folder is None:
        return Plan(source, None, {}, {}, cached=False)
    if source.kind == "gguf":
        check_gguf_header(source.path)
    digest, files = source_sha256(source)
    check_sha256(source, digest)
    settings = {"format": FORMAT, "source_sha256": digest, "dtype": c.dtype, "license": c.license}
    return Plan(source, digest, files, settings, *_up_to_date(Path(c.out), settings))


def check(recipe: Recipe) -> None:
    """align convert's checks, before any work (cli's Stage.check): the source is there and intact, and a GGUF's
    metadata and tensor table read (skipped when the folder is already up to date)."""
    p = plan(recipe)
    if not p.cached and p.source.kind == "gguf" and p.source.folder is not None:
        _gguf_metadata(p.source.path, p.sha256)


@functools.lru_cache(maxsize=4)
def _gguf_metadata(path: Path, sha256: Optional[str]) -> dict[str, Any]:
    # Read once per process: the check reads it, and the stage records it (the sha256 is in the key, so a file that
    # changed in between is read again).
    return read_gguf(path)


# --------------------------------------------------------------------------------------------------------------------
# converting
# --------------------------------------------------------------------------------------------------------------------
def _load(source: Source, dtype: Any) -> tuple[Any, Any, Any, Any]:
    """(model to save in `dtype`, tokenizer, generation config, the reference its logits are checked against)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if source.kind == "gguf":
        where = dict(gguf_file=source.gguf_file)
        # Dequantised to float32: the exact values the quantised blocks encode.
        reference = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32, **where)
        tokenizer = AutoTokenizer.from_pretrained(source.folder, **where)
        config = reference.config.to_dict()
        config.pop("quantization_config", None)  # what makes save_pretrained refuse: the weights are plain now
        config = type(reference.config).from_dict(config)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.load_state_dict(reference.state_dict(), strict=True)
        generation = GenerationConfig.from_model_config(config)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=dtype)
        reference = model
        tokenizer = AutoTokenizer.from_pretrained(source.folder)
        try:
            generation = GenerationConfig.from_pretrained(source.folder)
        except OSError:  # a folder without generation_config.json: its model config's token ids
            generation = GenerationConfig.from_model_config(model.config)
    return model.eval(), tokenizer, generation, reference.eval()


def _end_tokens(generation: Any, tokenizer: Any) -> list[int]:
    """generation_config's eos ids, with the template's end-of-turn token added: an instruct model's answer ends there
    (the GGUF names only its eos token)."""
    from align.chat import end_of_turn_ids

    found = generation.eos_token_id
    ids = [] if found is None else [found] if isinstance(found, int) else list(found)
    if tokenizer.chat_template:
        ids += end_of_turn_ids(tokenizer, tokenizer.get_chat_template())
    return sorted(set(ids))


def _license(c: ConvertSection, source: Source, gguf: dict[str, Any]) -> dict[str, Optional[str]]:
    """The licence: the recipe's, else the package's metadata, else the GGUF's general.license, else the source
    folder's model card; its Hub id (`other` when it is none, `unknown` when nothing states one)."""
    card = _card_license(source.path) if source.kind == "transformers" else None
    for stated, where in ((c.license, "convert.license"), (source.package_license, f"the {source.package} package's "
                          "metadata"), (gguf.get("license"), "the GGUF's general.license"),
                          (card, "the source folder's model card")):
        if stated:
            return {"id": hub_license(stated) or "other", "stated": stated, "from": where}
    return {"id": "unknown", "stated": None, "from": "nothing states one"}


def _card_license(folder: Path) -> Optional[str]:
    import yaml

    try:
        text = (folder / "README.md").read_text()
        front = yaml.safe_load(text.split("---")[1]) if text.startswith("---") else None
    except (OSError, IndexError, yaml.YAMLError):
        return None
    found = front.get("license") if isinstance(front, dict) else None
    return str(found) if found else None


def _model_card(source: Source, licence: dict[str, Optional[str]], gguf: dict[str, Any], dtype: str) -> str:
    from huggingface_hub import ModelCardData

    data = ModelCardData(license=licence["id"], library_name="transformers", pipeline_tag="text-generation",
                         tags=["align-convert"])
    origin = (f"`{source.gguf_file}`" + (f" from the `{source.package}` {source.version} package" if source.package
                                          else "")) if source.kind == "gguf" else f"`{source.folder}`"
    how = (f"dequantised from {gguf.get('quantization') or 'its quantisation'} by transformers' GGUF loader and saved in "
           f"{dtype}" if source.kind == "gguf" else f"saved in {dtype}")
    stated = f" ({licence['stated']}, from {licence['from']})" if licence["stated"] else ""
    return (f"---\n{data.to_yaml()}\n---\n\n# {gguf.get('name') or Path(str(source.path)).stem}\n\n"
            f"Converted by `align convert` from {origin}: {how}. Licence: `{licence['id']}`{stated}. "
            f"`{MANIFEST}` records the source's sha256 and the command.\n")


def _check_saved(folder: Path, reference: Any, tokenizer: Any, end_ids: list[int]) -> dict[str, Any]:
    """The saved folder loaded back as any user would, its logits on a chat-templated prompt against the reference's,
    and its greedy answer."""
    import torch
    from transformers import AutoModelForCausalLM

    from align.data import render_prompt

    saved = AutoModelForCausalLM.from_pretrained(folder).eval()
    # The exact check is on the weights: two float32 instances of the same weights need not give bitwise-equal logits
    # on this CPU (the kernels chosen can differ between them; 0.0048 was seen once in a test process).
    theirs = reference.state_dict()
    differing = [name for name, tensor in saved.state_dict().items()
                 if name not in theirs or not torch.equal(tensor, theirs[name].to(tensor.dtype))]
    template = tokenizer.get_chat_template() if tokenizer.chat_template else None
    # A base model (no template) reads plain text with the tokenizer's own special tokens (render_prompt): Gemma
    # without its BOS answers in garbage.
    ids = torch.tensor([render_prompt(tokenizer, PROBE, template)])
    with torch.inference_mode():
        diff = (saved(ids).logits.float() - reference(ids).logits.float()).abs().max().item()
        # The mask says every token is real: without one generate() hides each token equal to the pad id, and
        # SmolLM2's pad is its turn marker <|im_end|>.
        out = saved.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=PROBE_TOKENS, do_sample=False,
                             temperature=None, top_p=None, top_k=None, eos_token_id=end_ids or None,
                             pad_token_id=tokenizer.pad_token_id)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return {"prompt": PROBE, "chat_template": template is not None, "max_abs_logit_diff": diff,
            "weights_differing_from_source": differing,
            "greedy_answer": answer, "new_tokens": PROBE_TOKENS}


def main(recipe: Recipe, command: str) -> int:
    c = recipe.convert
    t0 = time.perf_counter()
    p = plan(recipe, assemble_parts=True)
    source, out = p.source, Path(c.out)
    what = f"{source.path.name}" + (f" ({source.package} {source.version})" if source.package else "")
    if p.cached:  # said before torch is imported: a cached run takes a second
        from align.disk import CHECKSUMS, record_checksums

        if not (out / CHECKSUMS).is_file():  # converted before align recorded them: every reader checks them now
            record_checksums(out)
        print(f"convert: {out} is up to date: converted from {what}, sha256 {p.sha256[:12]}…, {c.dtype}; nothing to do")
        return 0
    from align.disk import atomic_folder, file_sha256, record_checksums
    from align.data import template_sha256
    from align.models import DTYPES

    if p.changed:
        print(f"convert: {out / p.changed} is not the file the conversion there wrote; converting again")
    gguf = _gguf_metadata(source.path, p.sha256) if source.kind == "gguf" else {}
    print(f"convert: {what}, sha256 {p.sha256[:12]}… -> {out} ({c.dtype})")
    model, tokenizer, generation, reference = _load(source, DTYPES[c.dtype])
    end_ids = _end_tokens(generation, tokenizer)
    generation.eos_token_id = end_ids[0] if len(end_ids) == 1 else end_ids or None
    licence = _license(c, source, gguf)
    with atomic_folder(out, "convert") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        generation.save_pretrained(tmp)
        for file in source.license_files:  # the licence text travels with the weights, as on the Hub
            shutil.copy2(file, tmp / file.name)
        (tmp / "README.md").write_text(_model_card(source, licence, gguf, c.dtype))
        checked = _check_saved(tmp, reference, tokenizer, end_ids)
        if c.dtype == "float32" and (checked["weights_differing_from_source"] or checked["max_abs_logit_diff"] > 0.05):
            raise RuntimeError(f"the saved float32 weights differ from the source's "
                               f"({checked['weights_differing_from_source'][:3]}; max |logit Δ| "
                               f"{checked['max_abs_logit_diff']:.3g}): a conversion bug")
        config = model.config
        manifest = {
            "stage": "convert", "command": command, "settings": p.settings,
            "source": {"given": c.source, "kind": source.kind, "package": source.package,
                       "package_version": source.version, "file": source.gguf_file, "path": str(source.path),
                       "sha256": p.sha256, "sha256_checked_against": source.expected_from,
                       **({"files": p.files} if p.files else {}), **({"gguf": gguf} if gguf else {})},
            "license": licence,
            "dtype": c.dtype, "dequantised": source.kind == "gguf",
            "model": {"architecture": type(model).__name__, "parameters": model.num_parameters(),
                      "layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
                      "vocab_size": config.vocab_size, "tied_embeddings": bool(config.tie_word_embeddings),
                      "context": getattr(config, "max_position_embeddings", None)},
            "tokenizer": {"chat_template_sha256": template_sha256(tokenizer.get_chat_template()
                                                                  if tokenizer.chat_template else None),
                          "eos_token_ids": end_ids, "pad_token_id": tokenizer.pad_token_id},
            "check": checked,
            "versions": installed_versions("align-drafters", "transformers", "torch", "gguf"),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        manifest["files"] = {f.name: {"sha256": file_sha256(f), "bytes": f.stat().st_size}
                             for f in sorted(tmp.iterdir()) if f.is_file()}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        record_checksums(tmp)  # sha256.json: every later reader (models.load, the stages' checks) verifies the folder
    print(f"convert: {manifest['model']['architecture']}, {manifest['model']['parameters'] / 1e6:.1f}M parameters, "
          f"vocabulary {config.vocab_size}, licence {licence['id']}; logits vs the source max |Δ| "
          f"{checked['max_abs_logit_diff']:.3g}; {PROBE!r} -> {checked['greedy_answer'][:60]!r}; "
          f"{manifest['seconds']:.0f} s -> {out}")
    return 0

