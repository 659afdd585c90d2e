"""Reading what stages consume: prompt files (JSONL via `datasets`), prompts as token ids, and trajectories.

Problems a user can fix (a missing or malformed file, a prompt too long for the model, a corrupted chunk) are
`RecipeError`s naming the recipe key, so every stage refuses them the same way: one line, exit code 2.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from align.config import Recipe, RecipeError, get_key
from align.corpus import ensure_data

TRAJECTORY_MANIFEST = "manifest.json"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_prompt_file(path: str, field: str, key: str) -> list[str]:
    """Prompts from a JSONL file (via `datasets`): the `field` of each row; a list (Spec-Bench's turns) gives its
    first element. Problems are RecipeErrors naming `key`."""
    if not Path(path).is_file():
        raise RecipeError(f"{key}: no such file: {path}")
    try:  # datasets would report a non-UTF-8 file as a pyarrow parse error deep in a traceback
        with open(path, encoding="utf-8") as f:
            for _ in iter(lambda: f.read(1 << 20), ""):
                pass
    except UnicodeDecodeError as e:
        raise RecipeError(f"{key}: {path} is not UTF-8 text (byte {e.start}); JSONL files must be UTF-8") from None
    import datasets

    datasets.disable_progress_bars()  # a bar per small file is noise, and would split a refusal over lines
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its "Failed to load JSON" line would precede ours
    try:
        rows = datasets.load_dataset("json", data_files=path, split="train") if os.path.getsize(path) else []
    except Exception as e:  # datasets raises several types for a malformed file; all mean the same to the user
        raise RecipeError(f"{key}: cannot read {path} as JSONL ({type(e).__name__})") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
    if len(rows) and field not in rows.column_names:
        raise RecipeError(f"{key}: {path} has no '{field}' field (fields: {', '.join(rows.column_names)})")
    prompts = [r[field][0] if isinstance(r[field], list) else r[field] for r in rows]
    prompts = [p for p in prompts if isinstance(p, str) and p]
    if not prompts:
        raise RecipeError(f"{key}: {path} holds no prompts")
    return prompts


def tiny_prompts_path(recipe: Recipe, split: str, model_dir: str | None = None) -> str:
    """The tiny family's prompt set for `split` ("train" or "test"), built on first use."""
    data_dir = ensure_data(recipe.data.dir, recipe.bootstrap.corpus_fraction, model_dir)
    return str(data_dir / "prompts" / f"{split}.jsonl")


def eval_prompts(recipe: Recipe) -> list[str]:
    """eval.prompts, or the tiny test split; the first eval.num_prompts of them."""
    path = recipe.eval.prompts or tiny_prompts_path(recipe, "test", recipe.verifier.path)
    return load_prompt_file(path, recipe.eval.prompt_field, "eval.prompts")[: recipe.eval.num_prompts]


def encode_prompts(tokenizer: Any, prompts: list[str], max_new_tokens: int, context: int) -> list[torch.Tensor]:
    """Each prompt as (1, n) token ids; a prompt that cannot fit `max_new_tokens` more tokens in `context` is refused."""
    encoded = []
    for i, text in enumerate(prompts):
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        if ids.shape[1] + max_new_tokens > context:
            raise RecipeError(
                f"eval.prompts: prompt {i} has {ids.shape[1]} tokens; with decode.max_new_tokens={max_new_tokens} it "
                f"exceeds the model's context of {context} (use shorter prompts or fewer new tokens)"
            )
        encoded.append(ids)
    return encoded


def read_trajectory_manifest(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        return json.loads((path / TRAJECTORY_MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        raise RecipeError(f"trajectories.out: {path} has no readable {TRAJECTORY_MANIFEST} (run align trajectories)"
                          ) from None


def load_trajectories(path: str | Path) -> Any:
    """All chunks as one `datasets.Dataset`, each Arrow file checked against the manifest's checksum first."""
    from datasets import concatenate_datasets, load_from_disk

    path = Path(path)
    manifest = read_trajectory_manifest(path)
    parts = []
    for name, files in manifest["chunks"].items():
        for file, digest in files.items():
            target = path / "chunks" / name / file
            if not target.is_file() or file_sha256(target) != digest:
                raise RecipeError(f"trajectories: {target} is missing or corrupted (checksum mismatch); delete "
                                  f"{target.parent} and rerun align trajectories to regenerate it")
        parts.append(load_from_disk(str(path / "chunks" / name)))
    return concatenate_datasets(parts)


# recipe key -> its entry in the trajectories manifest's settings: trajectories made otherwise are not the data this
# recipe describes (another verifier, temperature or length), and training on them would be silently wrong.
TRAJECTORY_KEYS: dict[str, str] = {
    "verifier.path": "verifier",
    "trajectories.temperature": "temperature",
    "trajectories.top_p": "top_p",
    "trajectories.max_new_tokens": "max_new_tokens",
}


def _same_path(a: str, b: str) -> bool:
    return a == b or (Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve())


def check_trajectories_match(recipe: Recipe, manifest: dict[str, Any]) -> None:
    """Refuse trajectories whose manifest disagrees with the recipe (one line naming the first key that differs)."""
    made = manifest.get("settings", {})
    for key, name in TRAJECTORY_KEYS.items():
        wanted = get_key(recipe, key)
        if name not in made or (name == "top_p" and recipe.trajectories.temperature == 0):
            continue  # greedy trajectories ignore top_p (and a temperature mismatch is reported on its own)
        same = _same_path(str(wanted), str(made[name])) if name == "verifier" else wanted == made[name]
        if not same:
            raise RecipeError(f"{key}: the trajectories in {recipe.trajectories.out} were made with {made[name]!r}, "
                              f"the recipe says {wanted!r} (rerun align trajectories into another "
                              "trajectories.out, or set the key to match)")
