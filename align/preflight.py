"""Preflight: what a stage needs, checked before any work. Models (a local folder or a Hub id, complete weights, a
DrafterSpec, a shared vocabulary), input files, output folders, the context rule, and files other stages wrote. Each
check raises RecipeError with one line; the CLI (align/cli.py) runs them before a stage imports torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Optional

from align.config import ModelSection, Recipe, RecipeError, first_line
from align.drafters.spec import (KNOWN_DLLMS, SPEC_FIELDS, DrafterSpec, _stored_spec,
                            drafter_spec_from_config)
from align.hub import hub_offline, hub_snapshot, is_hub_id
from align.recipe_files import get_key

def check_vocab_compatible(verifier: Any, drafter: Any, drafter_key: str = "drafter.path") -> None:
    """Verifier and drafter must share a vocabulary: draft token ids are fed to the verifier as they are.

    Takes models or their configs, so that a stage can refuse a mismatch before loading any weights.
    """
    v_size, d_size = _vocab_size_of(verifier), _vocab_size_of(drafter)
    if v_size is not None and d_size is not None and v_size != d_size:
        raise RecipeError(
            f"{drafter_key}: vocabulary size {d_size} differs from the verifier's {v_size}; "
            "verifier and drafter must share a tokenizer"
        )


def _vocab_size_of(model_or_config: Any) -> Optional[int]:
    """A model's output rows, or a config's vocab_size (a multimodal config's is on its text part); None: unknown."""
    if hasattr(model_or_config, "get_output_embeddings"):
        return int(model_or_config.get_output_embeddings().weight.shape[0])
    size = getattr(model_or_config, "vocab_size", None)
    if size is None and hasattr(model_or_config, "get_text_config"):
        size = getattr(model_or_config.get_text_config(), "vocab_size", None)
    return None if size is None else int(size)


# --------------------------------------------------------------------------------------------------------------------
# inputs and outputs a stage needs, checked before any work
# --------------------------------------------------------------------------------------------------------------------
def check_model_path(key: str, value: str) -> None:
    """A model path is a local HF folder (with config.json) or, when the Hub is reachable, a Hub id."""
    local = Path(value)
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise RecipeError(f"{key}: {value} has no config.json (expected a Hugging Face model folder)")
        return
    if local.exists():
        raise RecipeError(f"{key}: {value} is a file; a model is a Hugging Face folder (with config.json) or a Hub id")
    if is_hub_id(value):
        if hub_offline() and hub_snapshot(value) is None:
            raise RecipeError(f"{key}: {value} is not a local folder, and the Hub is offline (HF_HUB_OFFLINE=1)")
        return
    raise RecipeError(f"{key}: no such model folder: {value}")


def check_file(key: str, value: Optional[str]) -> None:
    if value is not None and Path(value).is_dir():
        raise RecipeError(f"{key}: {value} is a folder; a file is expected")
    if value is not None and not Path(value).is_file():
        raise RecipeError(f"{key}: no such file: {value}")


def check_inputs(recipe: Recipe, model_keys: tuple[str, ...] = (), file_keys: tuple[str, ...] = ()) -> None:
    """Refuse missing models and files named by `recipe` before a stage starts any work."""
    for key in model_keys:
        check_model_path(key, get_key(recipe, key))
    for key in file_keys:
        check_file(key, get_key(recipe, key))


def check_weights(key: str, folder: Path) -> None:
    """Every weights file of a local model folder is there and complete, checked without reading a tensor.

    A safetensors file is an 8-byte header length, a JSON header giving each tensor's byte range, then the data, so
    the header alone says how long the file must be. A copy or download cut short is the usual failure; transformers
    would report it deep in loading, after the stage started.
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise RecipeError(f"{key}: {index} is not a readable safetensors index") from None
        for shard in shards:
            if not (folder / shard).is_file():
                raise RecipeError(f"{key}: {folder / shard} is missing (named in {index.name})")
    files = sorted(folder.glob("*.safetensors"))
    if not files and not any(folder.glob("pytorch_model*.bin")):
        raise RecipeError(f"{key}: {folder} has no weights (model.safetensors)")
    for path in files:
        problem = _safetensors_problem(path)
        if problem:
            raise RecipeError(f"{key}: {path} is truncated or corrupt ({problem}); copy or download it again")
    from align.disk import hashes_inputs, verify_checksums  # a folder align wrote: every file against its sha256.json

    if hashes_inputs():  # once a machine, or once before launching
        verify_checksums(folder, key)


def _safetensors_problem(path: Path) -> Optional[str]:
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else 0
        if not 0 < length <= size - 8:
            return f"its {size} bytes cannot hold its header"
        try:
            header = json.loads(f.read(length))
            end = max((t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return "its header is not valid JSON"
    if 8 + length + end != size:
        return f"its header describes {8 + length + end} bytes, the file has {size}"
    return None


def _section_of(key: str) -> str:
    """The recipe section whose settings (dtype, trust_remote_code, spec fields) apply to the model at `key`."""
    return "drafter" if key.startswith("eval.compare_drafters.") else key.split(".")[0]


def model_section(recipe: Recipe, key: str) -> ModelSection:
    """The model section for a model key: verifier.path, drafter.path, ar_drafter.path or eval.compare_drafters.<label>
    (a compared drafter is read with drafter's settings)."""
    section = getattr(recipe, _section_of(key))
    if key.startswith("eval.compare_drafters."):
        return section.model_copy(update={"path": get_key(recipe, key)})
    return section


def load_model_config(key: str, section: ModelSection) -> Any:
    """The model's config, once its folder (or Hub id) and weights files are checked; no weights are loaded."""
    check_model_path(key, section.path)
    if Path(section.path).is_dir():
        check_weights(key, Path(section.path))
    from transformers import AutoConfig  # imported here: seconds to import, and only stages with models need it

    # its import registers the DFlash drafter's config with AutoConfig (through align.drafters.dflash)
    import align.drafters.speculators_format as speculators_format
    from align.remote_code import install

    # Before any config is read: LLaDA's configuration module registers its class with AutoConfig on import, so a
    # config read before the shims would register (and keep for the process) the unshimmed class
    install()

    kind = speculators_format.speculators_type(section.path)  # a speculators folder: no model_type of its own
    if kind == "dflash":  # not align's: its config and weights' headers checked against the format, one line
        return speculators_format.check_speculators_folder(section.path, key)
    if kind is not None:
        raise RecipeError(f"{key}: {section.path} is a speculators {kind} drafter; align runs speculators DFlash "
                          "drafters only (speculators_model_type dflash)")
    try:
        return AutoConfig.from_pretrained(section.path, trust_remote_code=section.trust_remote_code)
    except Exception as e:  # OSError, ValueError, JSONDecodeError, KeyError...: to the user all mean the same
        if "trust_remote_code" in str(e) and not section.trust_remote_code:
            raise RecipeError(f"{key}: {section.path} ships its own modelling code; set "
                              f"{_section_of(key)}.trust_remote_code=true if you trust it") from None
        raise RecipeError(f"{key}: cannot read {section.path}/config.json ({first_line(e)})") from None


def check_drafter(key: str, section: ModelSection, config: Any, verifier_path: str) -> DrafterSpec:
    """A drafter is a diffusion LM whose DrafterSpec can be read (from its config or the recipe), and not the
    verifier: an AR model read as a drafter decodes garbage without failing."""
    path, verifier = Path(section.path), Path(verifier_path)
    if path.is_dir() and verifier.is_dir() and path.resolve() == verifier.resolve():
        raise RecipeError(f"{key}: {section.path} is the verifier (verifier.path); a drafter is a diffusion LM "
                          "such as checkpoints/tiny/drafter-base")
    overrides = {k: getattr(section, k, None) for k in SPEC_FIELDS}
    tokenizer = None
    if "mask_token_id" not in _stored_spec(config, None, overrides):  # only then is the tokenizer worth loading
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(section.path, trust_remote_code=section.trust_remote_code)
        except Exception:  # no usable tokenizer: the spec is then missing its mask token, said below
            tokenizer = None
    missing = [k for k in SPEC_FIELDS if k not in _stored_spec(config, tokenizer, overrides)]
    if missing:
        model_type = getattr(config, "model_type", None)
        raise RecipeError(
            f"{key}: {section.path} is not a diffusion drafter: its config.json has no drafter_spec and model_type "
            f"'{model_type}' is not a known dLLM ({', '.join(KNOWN_DLLMS)}); if it is one, set "
            f"{', '.join('drafter.' + k for k in missing)}")
    try:
        spec = drafter_spec_from_config(config, tokenizer, **overrides)
    except RecipeError as e:
        raise RecipeError(f"{key}: {str(e).removeprefix('drafter: ')}") from None
    vocab = _vocab_size_of(config)
    if vocab is not None and spec.mask_token_id >= vocab:
        where = "drafter.mask_token_id" if section.mask_token_id is not None else key  # the value to fix
        raise RecipeError(f"{where}: mask_token_id {spec.mask_token_id} is outside the vocabulary ({vocab}) of "
                          f"{section.path}")
    return spec


def check_autoregressive(key: str, path: str, config: Any) -> None:
    """The verifier and the AR drafter are causal LMs; a diffusion drafter there would be decoded as one."""
    model_type = str(getattr(config, "model_type", "")).lower()
    if getattr(config, "drafter_spec", None) or model_type in KNOWN_DLLMS:
        why = "its config.json has a drafter_spec" if getattr(config, "drafter_spec", None) else f"a {model_type} model"
        role = "the verifier" if key == "verifier.path" else "an AR drafter"
        raise RecipeError(f"{key}: {path} is a diffusion drafter ({why}); {role} must be an autoregressive LM")


def check_models(recipe: Recipe, keys: Iterable[str]) -> None:
    """The one check every stage's models go through before the stage starts; only configs and file headers are read.

    Each model is a local folder (or a Hub id, when online) whose config loads and whose weights files are complete;
    a drafter (drafter.path, eval.compare_drafters.*) is a diffusion drafter with a readable DrafterSpec and not the
    verifier; the verifier and AR drafter are not diffusion drafters; and every model shares the verifier's
    vocabulary when the stage uses the verifier.
    """
    keys = sorted(dict.fromkeys(keys), key=lambda k: k != "verifier.path")  # the verifier first: the others match it
    verifier_config = None
    for key in keys:
        section = model_section(recipe, key)
        config = load_model_config(key, section)
        if _section_of(key) == "drafter":
            check_drafter(key, section, config, recipe.verifier.path)
        else:
            check_autoregressive(key, section.path, config)
        if key == "verifier.path":
            verifier_config = config
        elif verifier_config is not None:
            check_vocab_compatible(verifier_config, config, key)
            if getattr(config, "model_type", None) == "align_dflash":  # it reads the verifier's layers
                from align.drafters.speculators_format import check_dflash_verifier

                check_dflash_verifier(config, verifier_config, key, section.path)


def check_output(key: str, value: str, writable: bool = True) -> None:
    """An output folder is a folder, or can be created: refused when it is an existing file, when the nearest existing
    path on its way is a file, or (`writable`) when that folder cannot be written (os.access: root passes it)."""
    path = Path(value)
    if path.is_symlink() and not path.exists():
        raise RecipeError(f"{key}: {value} is a dangling symbolic link (to {os.readlink(path)})")
    if path.exists() and not path.is_dir():
        raise RecipeError(f"{key}: {value} is an existing file; {key} names a folder (created when missing)")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise RecipeError(f"{key}: {existing} is a file, so the folder {value} cannot be created")
    if writable and not os.access(existing, os.W_OK | os.X_OK):
        needed = "" if existing == path else f" (needed to create {value})"
        raise RecipeError(f"{key}: {existing} is not writable{needed}")


# --------------------------------------------------------------------------------------------------------------------
# the context rule: one place, every stage (trajectories, train, gkd, calibrate, eval, serve-check) and the Python API
# --------------------------------------------------------------------------------------------------------------------
def context_length(config: Any) -> int:
    """The longest sequence a model is built for: `max_position_embeddings` (on the text part of multimodal configs:
    Gemma 4, DiffusionGemma), or `max_sequence_length` in LLaDA's OLMo-style config. Read from a config, so that
    stages check lengths before any weights load."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    length = getattr(text, "max_position_embeddings", None) or getattr(config, "max_sequence_length", None)
    if length is None:
        raise RecipeError(f"{getattr(config, 'model_type', 'model')}: its config gives no maximum sequence length")
    return int(length)


def fits_context(tokens: int, new_tokens: int, context: int) -> bool:
    """The rule: `tokens` read and `new_tokens` produced after them fit a model built for `context` positions. Past
    it, positions are ones the model never saw (RoPE extrapolates poorly): outputs degrade without any error."""
    return tokens + new_tokens <= context


def check_context(where: str, tokens: int, new_key: str, new_tokens: int, context: int, whose: str) -> None:
    """fits_context, or the one-line refusal every stage gives: `where` has `tokens` tokens; with `new_key`=
    `new_tokens` it exceeds `whose` context."""
    if not fits_context(tokens, new_tokens, context):
        raise RecipeError(f"{where} has {tokens} tokens; with {new_key}={new_tokens} it exceeds {whose} context of "
                          f"{context}")


def model_context(recipe: Recipe, keys: Iterable[str]) -> tuple[int, str]:
    """The shortest context of the models at `keys` (checked as check_models checks them), and that model's key."""
    found = [(context_length(load_model_config(key, model_section(recipe, key))), key) for key in keys]
    return min(found)


# --------------------------------------------------------------------------------------------------------------------
# files other stages wrote, read back: checked for their shape before any work
# --------------------------------------------------------------------------------------------------------------------
def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # NaN != NaN


def read_eval(path: str, key: Optional[str], numbers: tuple[str, ...]) -> dict[str, Any]:
    """An eval.json as `align eval` writes it: a JSON object whose `methods` map each method to an object whose
    `numbers` fields are numbers. Anything else is a RecipeError (prefixed by `key` when given) naming the file and
    the first field that is wrong, so a reader never fails halfway through its work."""
    where = f"{key}: " if key else ""

    def bad(why: str) -> RecipeError:
        return RecipeError(f"{where}{path} is not an eval.json written by align eval ({why})")

    if Path(path).is_dir():
        raise RecipeError(f"{where}{path} is a folder; an eval.json file is expected")
    try:
        evaluation = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RecipeError(f"{where}no such file: {path}") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise bad(f"not readable JSON: {first_line(e)}") from None
    if not isinstance(evaluation, dict) or not isinstance(evaluation.get("methods"), dict):
        raise bad("no `methods` object")
    if not evaluation["methods"]:
        raise bad("`methods` is empty")
    if not isinstance(evaluation.get("meta", {}), dict):
        raise bad("`meta` is not an object")
    for name, row in evaluation["methods"].items():
        if not isinstance(row, dict):
            raise bad(f"methods.{name} is not an object")
        for field in numbers:
            if not _number(row.get(field)):
                raise bad(f"methods.{name}.{field} is {json.dumps(row.get(field))}, a number is expected")
    return evaluation


def drafter_kind(recipe: Recipe, key: str = "drafter.path") -> str:
    """The drafter's DrafterSpec kind (standalone or dflash), from its config alone (check_drafter)."""
    section = model_section(recipe, key)
    return check_drafter(key, section, load_model_config(key, section), recipe.verifier.path).kind


def check_decodes_alone(recipe: Recipe, where: str) -> None:
    """A DFlash drafter drafts from the verifier's hidden states and never decodes on its own: refused from its config
    where the drafter decodes alone as a diffusion LM (`where`: align calibrate, eval.mode=dllm), before any weights
    load, rather than at its first block."""
    if drafter_kind(recipe) == "dflash":
        raise RecipeError(f"drafter.path: {recipe.drafter.path} is a DFlash drafter, which drafts from the verifier's "
                          f"hidden states and does not decode alone; {where} needs a standalone diffusion drafter")


def check_new_tokens(recipe: Recipe, new_key: str, model_keys: Iterable[str]) -> None:
    """`new_key` new tokens leave room for a prompt of at least one token in every model's context."""
    keys = tuple(model_keys)
    if not keys:
        return
    context, key = model_context(recipe, keys)
    new_tokens = get_key(recipe, new_key)
    if not fits_context(1, new_tokens, context):
        raise RecipeError(f"{new_key}: {new_tokens} new tokens leave no room for a prompt in the context of "
                          f"{get_key(recipe, key)} ({context} tokens, {key})")


# The keys whose default is the tiny family's own data, and what that default is. A real model prompted with functions
# of the standard library's source, or drafting against a trigram proxy fitted on them, runs without an error and
# measures nothing its user wants: such a run is refused instead (check_tiny_default).
TINY_DEFAULTS: dict[str, str] = {
    "data.train_prompts": "the tiny train split (functions of the Python standard library's source)",
    "eval.prompts": "the tiny test split (functions of the Python standard library's source)",
    "calibrate.prompts": "the tiny train split (functions of the Python standard library's source)",
    "decode.cps_proxy_corpus": "a trigram proxy fitted on the tiny corpus (the Python standard library's source)",
}


def _bootstrap_made(folder: Path) -> bool:
    """Whether `align bootstrap` wrote the model folder (its part manifest names the corpus it was trained on)."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and "part" in manifest and "corpus_hash" in manifest


def tiny_family(recipe: Recipe, model_key: str) -> bool:
    """Whether the model at `model_key` is of a tiny family: written by `align bootstrap`, or reading the vocabulary
    of bootstrap.out's tokenizer or of a bootstrap-made verifier (a drafter trained from one, whatever its folder is
    called). A Hub id or a folder without a tokenizer.json is not."""
    from tokenizers import Tokenizer  # the tokenizer files are compared by their vocabularies, not their bytes

    model = Path(model_section(recipe, model_key).path)
    if _bootstrap_made(model):
        return True
    references = [Path(recipe.bootstrap.out) / "tokenizer"]
    if _bootstrap_made(Path(recipe.verifier.path)):
        references.append(Path(recipe.verifier.path))
    references = [r / "tokenizer.json" for r in references if (r / "tokenizer.json").is_file()]
    if not (model / "tokenizer.json").is_file() or not references:
        return False
    try:
        vocab = Tokenizer.from_file(str(model / "tokenizer.json")).get_vocab()
        return any(vocab == Tokenizer.from_file(str(r)).get_vocab() for r in references)
    except Exception:  # noqa: BLE001 - a tokenizer.json `tokenizers` cannot read is not the tiny one
        return False


def check_tiny_default(recipe: Recipe, key: str, model_key: str) -> None:
    """Refuse a stage that would fall back to the tiny family's data (TINY_DEFAULTS[key], `key` unset) for a model that
    is not of the tiny family."""
    if get_key(recipe, key) is not None or tiny_family(recipe, model_key):
        return
    raise RecipeError(f"{key}: not set, so {TINY_DEFAULTS[key]} would be used, but "
                      f"{model_section(recipe, model_key).path} is not a tiny-family model; set {key} (for "
                      "training prompts, `align prompts` writes them from the verifier itself)")


