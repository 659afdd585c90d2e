"""Reading what stages consume: prompts (files, Hub-layout folders or Hub datasets, via `datasets`), prompts as the
token ids a model reads (one chat-template rendering for every stage), and trajectories.

Problems a user can fix (a missing or malformed file, an unknown column or split, a prompt too long for the model, a
corrupted chunk) are `RecipeError`s naming the recipe key, so every stage refuses them the same way: one line, exit
code 2. The cli runs `check_prompts` before a stage starts; the stage reads the same prompts with the same functions.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Union

import numpy as np

from align.config import Recipe, RecipeError, first_line
from align.recipe_files import get_key
from align.corpus import ensure_data
from align.disk import hashes_inputs, unchanged_file_sha256
from align.hub import hub_offline, is_hub_id
from align.preflight import check_context, check_tiny_default, fits_context, model_context, model_section

if TYPE_CHECKING:
    import torch

TRAJECTORY_MANIFEST = "manifest.json"
# One prompt in HELD_OUT_EVERY (prompt_index % HELD_OUT_EVERY == 0) is held out of training: align train measures the
# simulated accepted length and the final real τ on those prompts, and align derive adapts no drafter on them. Here,
# in a building block, because both stages read it and a stage cannot import another.
HELD_OUT_EVERY = 20

# A prompt is plain text, or a conversation of chat messages ({"role", "content"}) that ends on a turn the model
# answers (never an assistant turn).
Prompt = Union[str, list[dict[str, str]]]

# recipe key naming a prompt source -> the keys of its split, of the column holding the prompts, and of how many
# prompts the stage reads (None: all)
PROMPT_SOURCES: dict[str, tuple[str, str, str]] = {
    "data.train_prompts": ("data.train_split", "data.prompt_column", "trajectories.num_prompts"),
    "eval.prompts": ("eval.split", "eval.prompt_column", "eval.num_prompts"),
    "calibrate.prompts": ("calibrate.split", "calibrate.prompt_column", "calibrate.num_prompts"),
}
# What a benchmark source takes besides: recipe key -> the keys of its dataset config name, of its category filter
# (a `category` column, as Spec-Bench's and MT-Bench's), and of the column holding each prompt's stable id.
BENCHMARK_KEYS: dict[str, tuple[str, str, str]] = {
    "eval.prompts": ("eval.dataset_config", "eval.categories", "eval.id_field"),
}
CATEGORY_COLUMN = "category"
# The id columns of the usual benchmarks, looked for in this order when no id column is named: HumanEval's task_id,
# Spec-Bench's and MT-Bench's question_id, and the generic ones.
ID_COLUMNS = ("task_id", "question_id", "prompt_id", "id")


# --------------------------------------------------------------------------------------------------------------------
# prompt sources
# --------------------------------------------------------------------------------------------------------------------
@contextmanager
def _quiet_datasets() -> Iterator[Any]:
    import datasets

    datasets.disable_progress_bars()  # a bar per small file is noise, and would split a refusal over lines
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its "Failed to load JSON" line would precede ours
    try:
        yield datasets
    finally:
        datasets.logging.set_verbosity(verbosity)


def _read_dataset(path: str, split: str, key: str, split_key: str, config: Optional[str] = None,
                  config_key: Optional[str] = None, data_files: Optional[list[str]] = None,
                  revision: Optional[str] = None) -> Any:
    """The `split` of the dataset at `path` (a `datasets.Dataset`, or [] for an empty file), of its dataset config
    `config` (a Hub-layout folder or id with several, as GSM8K's `main` and `socratic`) when given; of a folder or Hub
    dataset, only `data_files` when given, and a Hub dataset at `revision`. The keys name each setting in a refusal
    (`key` the source; data_files and revision are `key`.data_files and `key`.revision, as a mixture names them)."""
    local = Path(path)
    if not local.exists() and local.suffix in (".jsonl", ".json", ".parquet"):
        raise RecipeError(f"{key}: no such file: {path}")  # a file's name, not a Hub id
    if not (local.exists() or is_hub_id(path)):
        raise RecipeError(f"{key}: no such file or folder: {path} (nor a Hub dataset id, org/name)")
    what = "a dataset folder" if local.is_dir() else "a Hub dataset"
    if local.is_file() and config is not None:
        raise RecipeError(f"{config_key}: {path} is a single file, which has no dataset configs (unset the key)")
    if local.is_file() and data_files is not None:
        raise RecipeError(f"{key}.data_files: {path} is a single file; data_files picks files of a folder or Hub dataset")
    if local.exists() and revision is not None:
        raise RecipeError(f"{key}.revision: {path} is local; a revision is a Hub dataset's branch, tag or commit")
    if local.is_file():
        if local.suffix == ".parquet":
            what = "Parquet"
        else:  # the existing convention: any other file is JSONL (a .json file of one array reads the same way)
            what = "JSONL"
            try:  # datasets would report a non-UTF-8 file as a pyarrow parse error deep in a traceback
                with open(local, encoding="utf-8") as f:
                    for _ in iter(lambda: f.read(1 << 20), ""):
                        pass
            except UnicodeDecodeError as e:
                raise RecipeError(f"{key}: {path} is not UTF-8 text (byte {e.start}); JSONL files must be UTF-8"
                                  ) from None
        if not local.stat().st_size:
            return []
    with _quiet_datasets() as datasets:
        try:
            if local.is_file():
                # A single file is one split, named as the recipe asks, so the split key never refuses a file.
                builder = "parquet" if what == "Parquet" else "json"
                return datasets.load_dataset(builder, data_files={split: str(local)}, split=split)
            # a Hub-layout folder or id: configs from its README's metadata, splits from file names
            return datasets.load_dataset(path, config, split=split, data_files=data_files, revision=revision)
        except ValueError as e:
            if config_key is not None and ("Config name is missing" in str(e) or "BuilderConfig" in str(e)):
                known = str(e).partition("[")[2].partition("]")[0].replace("'", "")
                wanted = "needs one" if config is None else f"has no config '{config}'"
                raise RecipeError(f"{config_key}: {path} {wanted} (configs: {known})") from None
            if "Unknown split" not in str(e):
                raise RecipeError(f"{key}: cannot read {path} as {what} ({first_line(e)})") from None
            known = str(e).partition("[")[2].partition("]")[0].replace("'", "")
            raise RecipeError(f"{split_key}: {path} has no split '{split}' (splits: {known})") from None
        except ConnectionError:
            if hub_offline() or os.environ.get("HF_DATASETS_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
                raise RecipeError(f"{key}: {path} is not a local file or folder, and the Hub is offline "
                                  "(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) with no copy in the datasets cache") from None
            raise RecipeError(f"{key}: cannot reach the Hub for the dataset {path}") from None
        except Exception as e:  # datasets raises several types for a malformed file; all mean the same to the user
            why = type(e).__name__ if what in ("JSONL", "Parquet") else first_line(e)
            raise RecipeError(f"{key}: cannot read {path} as {what} ({why})") from None


def conversation(messages: list[Any], where: str) -> list[dict[str, str]]:
    """Chat messages as the prompt: every message a {role, content} of strings; trailing assistant turns (the answer
    a chat dataset stores) are cut, so the conversation ends on the turn the model answers. The one rule for chat
    prompts: every stage's prompt sources and the Python API's prompts go through it."""
    for k, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise RecipeError(f"{where}: message {k} is not a {{role, content}} of strings ({str(message)[:80]})")
    end = len(messages)
    while end and messages[end - 1]["role"] == "assistant":
        end -= 1
    if not end:
        raise RecipeError(f"{where}: the conversation holds only assistant turns, so no prompt")
    # Only role and content: datasets fills a struct's missing keys (name, tool_calls) with None, which templates
    # would render as text.
    return [{"role": m["role"], "content": m["content"]} for m in messages[:end]]


def _as_prompt(value: Any, where: str) -> Optional[Prompt]:
    """A column value as a prompt: a string; a list of strings (Spec-Bench's `turns`) gives its first; a list of
    messages is a conversation. Empty values are skipped (None); anything else is refused."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value[0] or None
    if isinstance(value, list) and all(isinstance(v, dict) for v in value):
        return conversation(value, where)
    raise RecipeError(f"{where}: neither a string nor a list of chat messages ({type(value).__name__}: "
                      f"{str(value)[:80]})")


@dataclass
class PromptRow:
    """A prompt and where it came from: its row in the dataset split, and its id there (the id column's value as
    text; None when the rows hold no id column)."""

    prompt: Prompt
    row: int
    id: Optional[str] = None
    #: which source of a mixture it came from (data.train_prompts as a list); 0 for a single source
    source: int = 0


def _id_column(rows: Any, id_key: Optional[str], wanted: Optional[str], path: str) -> Optional[str]:
    if wanted is not None:
        if len(rows) and wanted not in rows.column_names:
            raise RecipeError(f"{id_key}: {path} has no '{wanted}' field (fields: {', '.join(rows.column_names)})")
        return wanted
    return next((c for c in ID_COLUMNS if len(rows) and c in rows.column_names), None)


def load_prompt_rows(recipe: Recipe, key: str, default: Optional[str] = None) -> list[PromptRow]:
    """The prompts of the source named by `key` (a PROMPT_SOURCES key), with its split and column keys, and for a
    benchmark source (BENCHMARK_KEYS) its dataset config, category filter and id column; when the key is unset, those
    of the tiny prompt file `default` (a JSONL with a `prompt` field). Only as many as the stage reads are converted
    and checked (a Hub chat dataset may hold hundreds of thousands). A list of sources is a mixture (mixture_rows)."""
    split_key, column_key, limit_key = PROMPT_SOURCES[key]
    config_key, categories_key, id_key = BENCHMARK_KEYS.get(key, (None, None, None))
    path = get_key(recipe, key)
    if isinstance(path, list):
        return mixture_rows(recipe, key, path)
    if path is not None:
        split, column = get_key(recipe, split_key), get_key(recipe, column_key)
    elif default is not None:
        path, split, column = default, "train", "prompt"
    else:
        raise RecipeError(f"{key}: no prompts given")
    config = get_key(recipe, config_key) if config_key else None
    categories = set(get_key(recipe, categories_key)) if categories_key else set()
    rows = _read_dataset(path, split, key, split_key, config, config_key)
    if categories and len(rows) and CATEGORY_COLUMN not in rows.column_names:
        raise RecipeError(f"{categories_key}: {path} has no '{CATEGORY_COLUMN}' field (fields: "
                          f"{', '.join(rows.column_names)})")
    id_column = _id_column(rows, id_key, get_key(recipe, id_key) if id_key else None, path)
    found, seen = _prompt_rows(rows, path, column, column_key, get_key(recipe, limit_key), categories, id_column)
    if not found and categories:
        raise RecipeError(f"{categories_key}: {path} holds no prompts in {', '.join(sorted(categories))} "
                          f"(categories: {', '.join(sorted(seen))})")
    if not found:
        raise RecipeError(f"{key}: {path} holds no prompts")
    return found


def _prompt_rows(rows: Any, path: str, column: str, column_key: str, limit: Optional[int],
                 categories: Optional[set[str]] = None, id_column: Optional[str] = None, source: int = 0
                 ) -> tuple[list[PromptRow], set[str]]:
    """The first `limit` (None: all) prompts of a read split's `column`, of the rows in `categories` when given; and
    the categories seen."""
    if len(rows) and column not in rows.column_names:
        raise RecipeError(f"{column_key}: {path} has no '{column}' field (fields: {', '.join(rows.column_names)})")
    columns = [column, *([CATEGORY_COLUMN] if categories else []), *([id_column] if id_column else [])]
    found: list[PromptRow] = []
    seen: set[str] = set()
    if len(rows):
        rows = rows.select_columns(list(dict.fromkeys(columns)))  # only what is read, batch by batch
    for start in range(0, len(rows), 1024):
        batch = rows[start : start + 1024]
        for i in range(len(batch[column])):
            row = start + i
            if categories:
                category = str(batch[CATEGORY_COLUMN][i])
                seen.add(category)
                if category not in categories:
                    continue
            prompt = _as_prompt(batch[column][i], f"{column_key}: row {row} of {path}")
            if prompt is not None:
                found.append(PromptRow(prompt, row, None if id_column is None else str(batch[id_column][i]), source))
            if limit is not None and len(found) == limit:
                return found, seen
    return found, seen


def mixture_counts(total: int, weights: list[float]) -> list[int]:
    """How many of `total` prompts each source of a mixture gives: shares by weight, rounded by largest remainder so
    that they sum to `total` (ties to the earlier source)."""
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(e) for e in exact]
    for i in sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))[: total - sum(counts)]:
        counts[i] += 1
    return counts


def mixture_rows(recipe: Recipe, key: str, sources: list[Any]) -> list[PromptRow]:
    """The prompts of a mixture (`key`'s value a list of PromptSource): trajectories.num_prompts of them, each source's
    share by weight (mixture_counts) taken from its first rows, and interleaved evenly, so that every chunk of
    trajectories and the held-out prompts (every HELD_OUT_EVERY-th) sample every source in its proportion."""
    split_key, column_key, limit_key = PROMPT_SOURCES[key]
    total = get_key(recipe, limit_key)
    if total is None:
        raise RecipeError(f"{limit_key}: a mixture ({key} as a list) draws this many prompts by weight; set it")
    counts = mixture_counts(total, [s.weight for s in sources])
    drawn: list[list[PromptRow]] = []
    for i, (source, count) in enumerate(zip(sources, counts)):
        where = f"{key}[{i}]"
        if not count:
            raise RecipeError(f"{where}.weight: {source.weight:g} gives it none of the {total} prompts "
                              f"({limit_key}); raise it, or leave the source out")
        split = source.split or get_key(recipe, split_key)
        column = source.prompt_column or get_key(recipe, column_key)
        rows = _read_dataset(source.path, split, where, f"{where}.split" if source.split else split_key, source.name,
                             f"{where}.name", source.data_files, source.revision)
        found, _ = _prompt_rows(rows, source.path, column, f"{where}.prompt_column" if source.prompt_column
                                else column_key, count, source=i)
        if len(found) < count:
            raise RecipeError(f"{where}: {source.path} holds {len(found)} prompts, fewer than its share of {limit_key} "
                              f"({count} of {total}); lower its weight or {limit_key}")
        drawn.append(found)
    order = sorted(((j + 0.5) / count, i, j) for i, count in enumerate(counts) for j in range(count))
    return [drawn[i][j] for _, i, j in order]


def load_prompts(recipe: Recipe, key: str, default: Optional[str] = None) -> list[Prompt]:
    """The prompts of load_prompt_rows, without where they came from."""
    return [r.prompt for r in load_prompt_rows(recipe, key, default)]


def tiny_prompts_path(recipe: Recipe, split: str, model_dir: str | None = None) -> str:
    """The tiny family's prompt set for `split` ("train" or "test"), built on first use."""
    data_dir = ensure_data(recipe.data.dir, recipe.bootstrap.corpus_fraction, model_dir)
    return str(data_dir / "prompts" / f"{split}.jsonl")


def eval_prompt_rows(recipe: Recipe) -> list[PromptRow]:
    """eval.prompts (split eval.split, column eval.prompt_column, config eval.dataset_config, rows of eval.categories),
    or the tiny test split; the first eval.num_prompts."""
    default = None if recipe.eval.prompts else tiny_prompts_path(recipe, "test", recipe.verifier.path)
    return load_prompt_rows(recipe, "eval.prompts", default)


def eval_prompts(recipe: Recipe) -> list[Prompt]:
    """The prompts of eval_prompt_rows."""
    return [r.prompt for r in eval_prompt_rows(recipe)]


# --------------------------------------------------------------------------------------------------------------------
# rendering: the one place a prompt becomes token ids
# --------------------------------------------------------------------------------------------------------------------
def chat_template(tokenizer: Any, mode: str, model_path: str) -> Optional[str]:
    """The chat template prompts are rendered with under data.chat_template=`mode`, or None for plain text.
    `model_path` names the tokenizer's model in a refusal."""
    if mode == "off":
        return None
    if tokenizer.chat_template:
        return tokenizer.get_chat_template()  # the default one when the tokenizer ships several
    if mode == "on":
        raise RecipeError(f"data.chat_template: on, but the tokenizer of {model_path} has no chat template (set "
                          "data.chat_template=auto or off for plain-text prompts)")
    return None


def template_sha256(template: Optional[str]) -> Optional[str]:
    """What manifests record of a template: the sha256 of its text, None when prompts are plain text."""
    return None if template is None else hashlib.sha256(template.encode()).hexdigest()


def recipe_chat_template(recipe: Recipe, model_key: str) -> Optional[str]:
    """The template the recipe renders prompts with, read from the tokenizer of the model at `model_key`."""
    if recipe.data.chat_template == "off":
        return None  # no tokenizer to load
    from align.models import load_tokenizer

    section = model_section(recipe, model_key)
    try:
        tokenizer = load_tokenizer(section.path, section.trust_remote_code)
    except (OSError, ValueError) as e:
        raise RecipeError(f"{model_key}: cannot load the tokenizer of {section.path} ({first_line(e)})") from None
    return chat_template(tokenizer, recipe.data.chat_template, section.path)


def render_prompt(tokenizer: Any, prompt: Prompt, template: Optional[str]) -> list[int]:
    """The token ids of `prompt` as every stage feeds them to the model (trajectories, eval, calibration; training
    windows read trajectories' ids).

    With a template, the conversation (a plain prompt is one user turn) is rendered with add_generation_prompt=True,
    so the ids end where the answer begins. The rendered text already holds the template's special tokens (a BOS, turn
    markers), so it is tokenized with add_special_tokens=False: a tokenizer that adds a BOS of its own would otherwise
    give two. Plain text gets what its tokenizer adds (a BOS for Gemma and Llama 3, whose models were trained with one
    and drift without it; nothing for the tiny family or SmolLM2), as `tokenizer(text)` and `generate()` users see it.
    """
    if template is None:
        if not isinstance(prompt, str):
            raise RecipeError("data.chat_template: chat-message prompts need a chat template, and none is applied "
                              "(data.chat_template=off, or the tokenizer has none)")
        return tokenizer(prompt).input_ids
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def prompt_ids_sha256(prompt_ids: list[list[int]]) -> str:
    """What manifests record of the prompts a model read: equal exactly when the token ids are."""
    return hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()


def prompt_id(row: PromptRow, prompt_ids: list[int]) -> str:
    """A prompt's stable id in reports: its dataset's id (HumanEval/0, a Spec-Bench question_id), or else
    `sha256:` and the first 16 hex digits of its token ids' sha256 (the same prompt rendered the same way)."""
    return row.id if row.id is not None else "sha256:" + prompt_ids_sha256([prompt_ids])[:16]


def prompt_places(rows: list[PromptRow], prompt_ids: list["torch.Tensor"]) -> list[dict[str, Any]]:
    """What a report's per-prompt record says of each prompt: its index in the run, its dataset row, its stable id
    (prompt_id) and its length in tokens. prompt_ids: each prompt's (1, n) ids, as encode_prompts gives them."""
    return [{"index": i, "row": r.row, "id": prompt_id(r, ids[0].tolist()), "prompt_tokens": ids.shape[1]}
            for i, (r, ids) in enumerate(zip(rows, prompt_ids))]


def encode_prompts(tokenizer: Any, prompts: list[Prompt], template: Optional[str], max_new_tokens: int,
                   context: int) -> list["torch.Tensor"]:
    """Each prompt rendered (render_prompt) as (1, n) token ids; a prompt that cannot fit `max_new_tokens` more tokens
    in `context` is refused."""
    import torch

    encoded = []
    for i, prompt in enumerate(prompts):
        ids = render_prompt(tokenizer, prompt, template)
        check_context(f"eval.prompts: prompt {i}", len(ids), "decode.max_new_tokens", max_new_tokens, context,
                      "the model's")
        # On the CPU: prompts are checked before any model is loaded; callers move them to the model's device.
        encoded.append(torch.tensor([ids], dtype=torch.long, device="cpu"))
    return encoded


def check_prompts(recipe: Recipe, key: str, model_key: str) -> None:
    """What the cli checks before a stage reads the prompts at `key` with the tokenizer of `model_key`: the template
    data.chat_template asks for exists, and the source (when set) reads, has the split and column, holds well-formed
    prompts, and chat messages only where a template applies."""
    template = recipe_chat_template(recipe, model_key)
    if get_key(recipe, key) is None:
        check_tiny_default(recipe, key, model_key)
        return  # the tiny prompt sets: plain strings, built on first use by the stage
    chat = next((row for row in load_prompt_rows(recipe, key) if not isinstance(row.prompt, str)), None)
    if template is None and chat is not None:
        why = "data.chat_template=off" if recipe.data.chat_template == "off" else \
            f"the tokenizer of {model_section(recipe, model_key).path} has none"
        source = get_key(recipe, key)
        where = f"{key}[{chat.source}]: {source[chat.source].path}" if isinstance(source, list) else \
            f"{PROMPT_SOURCES[key][1]}: {source}"
        raise RecipeError(f"{where} holds chat messages, which need a chat template ({why})")


# --------------------------------------------------------------------------------------------------------------------
# the end-token rule: one place, for every stage that decodes with a verifier (trajectories, eval, calibrate,
# serve-check, the Python API). Torch-free, so that checks before any model loads can apply it.
# --------------------------------------------------------------------------------------------------------------------
def eos_token_ids(verifier: Any, tokenizer: Any) -> frozenset[int]:
    """The tokens that end a generation of `verifier`: its generation_config.eos_token_id (an int or a list: instruct
    models list their end-of-turn token there, which the tokenizer's single eos_token may not be, as Gemma 3-it's
    <end_of_turn> beside its <eos>) and the tokenizer's eos_token_id, deduplicated. `verifier`: the loaded model, or
    its GenerationConfig where no HF model is loaded (generation_config_of; trajectories with vLLM), or None."""
    generation = getattr(verifier, "generation_config", verifier)
    configured = getattr(generation, "eos_token_id", None)
    configured = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    own = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return frozenset(int(t) for t in (*configured, *own))


def generation_config_of(path: str) -> Any:
    """The GenerationConfig transformers' from_pretrained gives the model at `path` (a folder or a cached Hub id), read
    without its weights as from_pretrained reads it: generation_config.json, else one built from config.json."""
    from transformers import GenerationConfig  # seconds to import, and only stages with models need it

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json
        return GenerationConfig.from_pretrained(path, config_file_name="config.json", _from_model_config=True)


def verifier_end_tokens(recipe: Recipe, tokenizer: Any) -> list[int]:
    """eos_token_ids of the recipe's verifier (`tokenizer` is its tokenizer), sorted, read from its files without its
    weights: where its trajectories stop, as eval's decoding of the loaded verifier stops."""
    return sorted(eos_token_ids(generation_config_of(recipe.verifier.path), tokenizer))


def read_trajectory_manifest(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        return json.loads((path / TRAJECTORY_MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        raise RecipeError(f"trajectories.out: {path} has no readable {TRAJECTORY_MANIFEST} (run align trajectories)"
                          ) from None


def verify_trajectory_files(path: str | Path) -> None:
    """Every Arrow file of the trajectories at `path` against the manifest's checksum (RecipeError naming the first
    that differs); a file already checked in this process, unchanged since, is not hashed again."""
    path = Path(path)
    for name, files in read_trajectory_manifest(path)["chunks"].items():
        for file, digest in files.items():
            target = path / "chunks" / name / file
            if not target.is_file() or unchanged_file_sha256(target) != digest:
                raise RecipeError(f"trajectories: {target} is missing or corrupted (checksum mismatch); delete "
                                  f"{target.parent} and rerun align trajectories to regenerate it")


def load_trajectories(path: str | Path, verify: bool = True) -> Any:
    """All chunks as one `datasets.Dataset` in prompt order (by `prompt_index`, a prompt's completions in the order
    sampled), each Arrow file checked against the manifest's checksum first (`verify`: False where another process
    of this machine or the launcher has: disk.hashes_inputs). Chunks are cut longest prompt first for the
    verifier's batches (stages/trajectories.py): that order is the sampler's, not the data's."""
    import numpy as np
    from datasets import concatenate_datasets, load_from_disk

    path = Path(path)
    manifest = read_trajectory_manifest(path)
    if verify:
        verify_trajectory_files(path)
    parts = []
    for name in manifest["chunks"]:
        try:  # its Arrow files are checked; its small JSON files (state, dataset info) can still be damaged
            parts.append(load_from_disk(str(path / "chunks" / name)))
        except Exception as e:
            raise RecipeError(f"trajectories: {path / 'chunks' / name} cannot be read ({first_line(e)}); delete it "
                              "and rerun align trajectories to regenerate it") from None
    data = concatenate_datasets(parts)
    if "prompt_index" not in data.column_names:
        return data
    prompt_index = np.asarray(data["prompt_index"])
    if np.all(prompt_index[1:] >= prompt_index[:-1]):
        return data
    # an index mapping held in memory: a cache file would land inside the checksummed chunk folders
    return data.select(np.argsort(prompt_index, kind="stable"), keep_in_memory=True)


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
    # Prompts rendered with another chat template (or none) are other token sequences: the drafter would learn to
    # draft after prompts the verifier will never be given. Manifests from before templates rendered nothing.
    made_with = made.get("chat_template_sha256")
    wanted = template_sha256(recipe_chat_template(recipe, "verifier.path"))
    if made_with != wanted:
        def name(digest: Optional[str]) -> str:
            return "no chat template" if digest is None else f"the chat template sha256 {digest[:12]}"

        raise RecipeError(f"data.chat_template: the trajectories in {recipe.trajectories.out} were rendered with "
                          f"{name(made_with)}, the recipe ({recipe.data.chat_template}, {recipe.verifier.path}) gives "
                          f"{name(wanted)} (rerun align trajectories into another trajectories.out, or set "
                          "data.chat_template to match)")
    # Completions stopped at other end tokens are other texts: stopped short of the verifier's end-of-turn token, they
    # run on past the turn, and the drafter learns to continue where the verifier stops. Trajectories made before the
    # end tokens were recorded stopped at the tokenizer's eos alone; they are still read where that is the same rule.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(recipe.verifier.path, trust_remote_code=recipe.verifier.trust_remote_code)
    wanted_ends = verifier_end_tokens(recipe, tokenizer)
    made_ends = made.get("end_token_ids")
    if made_ends is None and wanted_ends != [tokenizer.eos_token_id]:
        raise RecipeError(f"trajectories.out: the trajectories in {recipe.trajectories.out} stopped at the tokenizer's "
                          f"eos only (made before align stopped them at the verifier's end tokens {wanted_ends}, as "
                          "eval does); rerun align trajectories into another trajectories.out")
    if made_ends is not None and sorted(made_ends) != wanted_ends:
        raise RecipeError(f"trajectories.out: the trajectories in {recipe.trajectories.out} stopped at the end tokens "
                          f"{sorted(made_ends)}, the verifier {recipe.verifier.path} ends generations at {wanted_ends} "
                          "(rerun align trajectories into another trajectories.out)")


def load_checked_trajectories(recipe: Recipe) -> Any:
    """The trajectories of trajectories.out, as every stage that trains on them reads them (align train, align gkd):
    refused when the manifest disagrees with the recipe (check_trajectories_match) or a chunk fails its checksum
    (checked once a machine: disk.hashes_inputs; the stages that launch ranks check it before launching)."""
    check_trajectories_match(recipe, read_trajectory_manifest(recipe.trajectories.out))
    return load_trajectories(recipe.trajectories.out, verify=hashes_inputs())


def check_rows_fit(recipe: Recipe, tokens: list[int], new_key: str, new_tokens: int, model_keys: Iterable[str]) -> None:
    """Every trajectory fits the context of the models at `model_keys` (fits_context) when a stage reads `tokens[i]`
    of row i and produces `new_tokens` (the value of `new_key`) after them; else one line naming the first row."""
    context, key = model_context(recipe, model_keys)
    for i, n in enumerate(tokens):
        if not fits_context(n, new_tokens, context):
            raise RecipeError(f"{new_key}: row {i} of {recipe.trajectories.out} reads {n} tokens; with {new_key}="
                              f"{new_tokens} it exceeds the context of {get_key(recipe, key)} ({context} tokens, "
                              f"{key}); make trajectories with shorter prompts or fewer new tokens")


# The order of training rows: every batch a function of (seed, step, rank), so that a resumed run reproduces the
# batches an uninterrupted one would have had (align/stages/train.py).
def stream_position(step: int, micro: int, rank: int, world: int, recipe: Recipe) -> int:
    """Where a micro-batch starts in the stream of training rows. Steps, micro-batches and ranks interleave so that
    the same global batch holds the same rows whatever the split into processes and accumulation steps."""
    t = recipe.train
    return ((step * t.gradient_accumulation_steps + micro) * world + rank) * t.micro_batch_size


@functools.lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, n_rows: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n_rows)


def rows_at(position: int, count: int, seed: int, n_rows: int) -> list[int]:
    """`count` row indices from `position` on; each epoch is a fresh permutation of the rows."""
    return [int(epoch_order(seed, pos // n_rows, n_rows)[pos % n_rows]) for pos in range(position, position + count)]


def rank_share(indices: list[int], rank: int, world: int) -> tuple[list[int], list[float]]:
    """This rank's share of `indices` and a weight per row (0 for padding). Every rank gets the same number of rows,
    so that under ZeRO-3, where each forward is a collective, all ranks make the same number of forwards."""
    per_rank = -(-len(indices) // world)
    mine = indices[rank::world]
    padding = per_rank - len(mine)
    return mine + indices[:1] * padding, [1.0] * len(mine) + [0.0] * padding
