"""Model cards: the README.md of an exported folder, from the run's records and eval.json alone.

The card's metadata is written with huggingface_hub's `ModelCardData` (base model, licence inherited from the base
model, datasets, `model-index` with the measured τ and speedup); its table comes from the eval.json rows of the
exported drafter (`drafter_rows`), and its usage section shows how to load and draft with it. Models and data are
named as align/provenance.py names them: never by a path of the machine that exported them.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from align.config import Recipe, RecipeError
from align.drafters.spec import CANVAS_DECODER_FAMILIES
from align.hub import HUB_LICENSES, hub_offline, is_hub_id
from align.provenance import HUB, Origin, origin

# --------------------------------------------------------------------------------------------------------------------
# the licence, inherited from the base model
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Licence:
    license: str
    name: Optional[str]
    link: Optional[str]
    why: str  # one sentence for the card: where the licence comes from

    def card_line(self) -> str:
        """The card's "Models and data" line on the licence."""
        return f"- Licence: `{self.license}`" + (f" ({self.name}, {self.link})" if self.name else "") + f", {self.why}"


def card_metadata(base: Origin) -> Optional[dict[str, Any]]:
    """The front matter of the base model's README.md: in its folder, in the Hub cache, or (online) from the Hub."""
    from huggingface_hub import metadata_load, try_to_load_from_cache

    readme = base.folder / "README.md" if base.folder else None
    if (readme is None or not readme.is_file()) and base.hub_id:
        cached = try_to_load_from_cache(base.hub_id, "README.md")
        readme = Path(cached) if isinstance(cached, str) else None
        if readme is None and not hub_offline():
            from huggingface_hub import hf_hub_download

            try:
                readme = Path(hf_hub_download(base.hub_id, "README.md"))
            except Exception:  # no README, a gated or private repo, no network: the licence stays unknown
                readme = None
    if readme is None or not readme.is_file():
        return None
    try:
        return metadata_load(readme) or {}
    except Exception:  # front matter that is not YAML: treated as none
        return {}


def licence(recipe: Recipe, base: Origin) -> Licence:
    """export.license when the recipe sets one; otherwise the base model's (its card's `license`, with
    `license_name`/`license_link` for `other`); otherwise `unknown`, said so in the card: a licence is not guessed."""
    e = recipe.export
    if e.license is not None:
        return Licence(e.license, e.license_name, e.license_link, "set by the export recipe (`export.license`).")
    metadata = card_metadata(base)
    found = (metadata or {}).get("license")
    if isinstance(found, list):
        found = found[0] if len(found) == 1 else None
    if isinstance(found, str) and found in HUB_LICENSES and found != "unknown":
        link = metadata.get("license_link")
        if isinstance(link, str) and not re.match(r"^[a-z]+://", link) and base.hub_id:
            link = f"{HUB}/{base.hub_id}/blob/main/{link}"  # the base's own LICENSE file, not a copy here
        name = metadata.get("license_name") if found == "other" else None
        if found == "other" and not (name and isinstance(link, str)):
            return Licence("unknown", None, None, f"unknown: the base model {base.markdown()} says `other` without "
                           "license_name and license_link, so this card cannot say which; set `export.license`.")
        return Licence(found, name, link if found == "other" else None,
                       f"inherited from the base model {base.markdown()} (its model card's `license`).")
    if isinstance(found, str) and found != "unknown" and base.hub_id:
        # A licence id the Hub added after align's list: kept by name, linked to the base's card, which shows it.
        link = metadata.get("license_link")
        link = link if isinstance(link, str) and re.match(r"^[a-z]+://", link) else f"{HUB}/{base.hub_id}"
        slug = re.sub(r"[^a-z0-9.-]+", "-", found.lower()).strip("-.") or "base-model-license"
        return Licence("other", slug, link, f"inherited from the base model {base.markdown()}, whose card says "
                       f"`{found}` (not in align's list of Hub licence ids, so written as `other`).")
    if isinstance(found, str) and found != "unknown":
        return Licence("unknown", None, None, f"unknown: the base model {base.markdown()} says `{found}`, which is "
                       "not a Hub licence id; set `export.license` to choose.")
    where = "states no licence (its model card has no `license`)" if metadata is not None else "has no model card"
    return Licence("unknown", None, None,
                   f"unknown: the base model {base.markdown()} {where}, and the export recipe sets none, so this card "
                   "does not guess one. Set `export.license` (a Hub licence id) to choose.")


# --------------------------------------------------------------------------------------------------------------------
# data sets and measurements
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataSource:
    hub_id: Optional[str]  # a Hub dataset id, for the card's `datasets`
    name: str
    described: str


def data_source(value: Optional[str], default: str) -> DataSource:
    """A prompt source as the card names it: a Hub dataset id stays; a local file becomes its name and sha256."""
    if not value or value == default:
        return DataSource(None, default, default)
    local = Path(value)
    if local.is_file():
        with local.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()  # in chunks: prompt files can be large
        return DataSource(None, local.name, f"`{local.name}` (a local file, sha256 `{digest}`)"
                          + made_by_align(local, digest))
    if local.is_dir():
        return DataSource(None, local.resolve().name, f"`{local.resolve().name}` (a local dataset folder)")
    if is_hub_id(value):
        return DataSource(value, value, f"[{value}]({HUB}/datasets/{value})")
    return DataSource(None, local.name, f"`{local.name}` (a local file, not found at export)")


def made_by_align(file: Path, digest: str) -> str:
    """Where a prompt file an align stage wrote came from, and its licence situation (`align sharegpt`'s manifest
    beside it, when it still lists this very file): "" for any other file."""
    try:
        manifest = json.loads((file.parent / "manifest.json").read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(manifest, dict) or (manifest.get("files") or {}).get(file.name) != digest:
        return ""
    if "licence" not in manifest:
        return ""
    source = manifest.get("source") or {}
    origin = source.get("package") or Path(str(source.get("file", "?"))).name
    return f", written by `align {manifest.get('stage')}` from {origin}. {manifest['licence']}"


def hardware(machine: dict[str, Any]) -> str:
    """Where eval.json's numbers were measured: the accelerator when one ran them, else the CPU model."""
    device = str(machine.get("device") or "")
    gpu = next((machine[k] for k in ("gpu_name", "gpu") if machine.get(k)), None)
    cpu = next((machine[k] for k in ("cpu_model", "cpu", "processor") if machine.get(k)), None) or "?"
    if gpu and not device.startswith("cpu"):
        return str(gpu)
    return f"{cpu}" + (f", {machine['torch_threads']} threads" if machine.get("torch_threads") else "")


def recorded_drafters(evaluation: dict[str, Any]) -> list[dict[str, Any]]:
    """The drafters eval.json has rows for (meta.drafters, schema 3): {rows ("" or "@<label>"), path, resolved,
    weights_sha256}. An older file names them only by the paths the recipe gave (meta.drafter, meta.compare_drafters),
    read as they are, against this folder."""
    meta = evaluation.get("meta") or {}
    if isinstance(meta.get("drafters"), list):
        return meta["drafters"]
    return ([{"rows": "", "path": meta["drafter"]}] if meta.get("drafter") else []) + [
        {"rows": f"@{label}", "path": path} for label, path in (meta.get("compare_drafters") or {}).items()]


_WEIGHTS_SHA256: dict[tuple, Optional[str]] = {}


def exported_weights_sha256(drafter_path: str) -> Optional[str]:
    """drafter_identity's weights_sha256 of the exported drafter, hashed once per state of its files (the card's
    functions each ask)."""
    from align.checkpoint import drafter_identity

    folder = Path(drafter_path)
    key = (str(folder.resolve()), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                                        for f in sorted(folder.glob("*")) if f.is_file())) if folder.is_dir() else (
        drafter_path,)
    if key not in _WEIGHTS_SHA256:
        _WEIGHTS_SHA256[key] = drafter_identity(drafter_path)["weights_sha256"]
    return _WEIGHTS_SHA256[key]


def drafter_suffix(evaluation: dict[str, Any], drafter_path: str) -> Optional[str]:
    """Which of eval.json's rows measured the exported drafter: "" for its plain rows (it was the eval's drafter.path),
    `@<label>` for eval.compare_drafters' `<method>@<label>` rows, None when none did. Where eval.json recorded the
    weights' sha256 they decide (a moved or copied folder is the same drafter; a folder trained further since is
    not); else the resolved path (schema 3's absolute one; an older file's path as given, against this folder)."""
    for entry in recorded_drafters(evaluation):
        if entry.get("weights_sha256"):
            if entry["weights_sha256"] == exported_weights_sha256(drafter_path):
                return entry["rows"]
        elif _same_model(entry.get("resolved") or entry.get("path"), drafter_path):
            return entry["rows"]
    return None


def _same_model(recorded: Optional[str], path: str) -> bool:
    if not recorded:
        return False
    if is_hub_id(recorded) and not Path(recorded).is_dir():
        return recorded == path
    return Path(recorded).expanduser().resolve() == Path(path).expanduser().resolve()


def check_eval_rows(recipe: Recipe) -> None:
    """Refuse, before any work, an export.eval without rows of the exported drafter: its card would carry another
    drafter's numbers as this one's."""
    if not recipe.export.eval:
        return
    try:
        evaluation = json.loads(Path(recipe.export.eval).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise RecipeError(f"export.eval: {recipe.export.eval} is not JSON ({type(e).__name__}); give the eval.json "
                          "that align eval wrote") from None
    if not isinstance(evaluation, dict) or not isinstance(evaluation.get("methods"), dict):
        raise RecipeError(f"export.eval: {recipe.export.eval} is not an eval.json of align eval (no `methods`)")
    if drafter_suffix(evaluation, recipe.drafter.path) is None:
        measured = ", ".join(f"{e.get('path')} ({'drafter.path' if not e['rows'] else 'eval.compare_drafters.' + e['rows'][1:]})"
                             for e in recorded_drafters(evaluation)) or "no diffusion drafter"
        raise RecipeError(f"export.eval: {recipe.export.eval} has no rows for the exported drafter "
                          f"{recipe.drafter.path} (it measured {measured}); run align eval with it as drafter.path or "
                          "in eval.compare_drafters")


def _rows_of(evaluation: dict[str, Any], drafter_path: str) -> str:
    """drafter_suffix, refused when None (export checked it before any work: check_eval_rows)."""
    suffix = drafter_suffix(evaluation, drafter_path)
    if suffix is None:
        raise RecipeError(f"eval.json has no rows for the exported drafter {drafter_path}")
    return suffix


def drafter_rows(evaluation: dict[str, Any], drafter_path: str) -> dict[str, dict[str, Any]]:
    """eval.json's rows of the exported drafter by method name: its own (`specdiff@<label>`) when eval.json compared
    it with other drafters under a label, else the plain ones."""
    methods = evaluation["methods"]
    suffix = _rows_of(evaluation, drafter_path)
    return {name: methods[name + suffix] for name in methods
            if name.startswith("specdiff") and "@" not in name and name + suffix in methods}


def eval_results(evaluation: dict[str, Any], drafter_path: str, verifier: Origin) -> list[Any]:
    """model-index entries: τ and speedup of each of the drafter's methods on eval.json's prompts, with the hardware
    and settings they were measured with."""
    from huggingface_hub import EvalResult

    m = evaluation.get("meta", {})
    prompts = data_source(m.get("prompts"), "tiny test split")
    decode = (m.get("recipe") or {}).get("decode") or {}
    settings = {"verifier": verifier.hub_id or verifier.name, "hardware": hardware(m.get("machine") or {}),
                "temperature": 0, "num_prompts": m.get("num_prompts"), "gamma": decode.get("gamma"),
                "max_new_tokens": decode.get("max_new_tokens"), "baseline": m.get("baseline")}
    settings = {k: v for k, v in settings.items() if v is not None}
    # The Hub groups results by task and dataset (huggingface_hub's EvalResult.unique_identifier) and names the group
    # after its first result, so the method goes in each metric's name and args, not in the task's name: every
    # method's τ and speedup are then metrics of one result, each read back under its own method.
    common = dict(task_type="text-generation", task_name=f"Speculative decoding with {verifier.short}",
                  dataset_type=prompts.hub_id or re.sub(r"[^\w.-]+", "-", prompts.name).strip("-"),
                  dataset_name=prompts.name)
    results = []
    for method, row in drafter_rows(evaluation, drafter_path).items():
        args = {"method": method, **settings}
        results.append(EvalResult(metric_type="mean_accepted_length", metric_args=args,
                                  metric_name=f"{method}: τ (tokens per verifier forward)",
                                  metric_value=round(float(row["tau"]), 4), **common))
        results.append(EvalResult(metric_type="speedup", metric_args=args,
                                  metric_name=f"{method}: speedup vs the {m.get('baseline', 'AR baseline')}",
                                  metric_value=round(float(row["speedup"]), 4), **common))
    return results


def front_matter(*, title: str, base: Origin, relation: Optional[str], licence_: Licence, library: str,
                 tags: list[str], datasets: list[str], results: list[Any]) -> str:
    """The card's YAML front matter, written by huggingface_hub's ModelCardData (the Hub's own field names)."""
    from huggingface_hub import ModelCardData

    data = ModelCardData(
        model_name=title if results else None, license=licence_.license, license_name=licence_.name, license_link=licence_.link,
        # `other`, not text-generation: a drafter only proposes tokens for a verifier (alone its text is no model's
        # output), and without a tag the Hub would infer text-generation from the architecture and offer a widget.
        library_name=library, pipeline_tag="other", tags=tags, datasets=datasets or None,
        base_model=base.hub_id, base_model_relation=relation if base.hub_id else None,
        eval_results=results or None,
    )
    return f"---\n{data.to_yaml()}\n---\n"


def title(recipe: Recipe, what: str) -> str:
    """The card's title: the Hub repo's name when pushed, else what the drafter is (never the output folder's name)."""
    return recipe.export.push_to_hub.split("/")[-1] if recipe.export.push_to_hub else what


def training_data(meta: dict[str, Any]) -> list[DataSource]:
    """The prompts the verifier continued for the training trajectories (data.train_prompts of the training run): its
    source, or each source of a mixture with its weight."""
    value = ((meta.get("recipe") or {}).get("data") or {}).get("train_prompts")
    if not isinstance(value, list):
        return [data_source(value, "the tiny train split (functions of the Python standard library's source)")]
    total = sum(source["weight"] for source in value)
    return [replace(found, described=f"{found.described} ({source['weight'] / total:.0%} of them)")
            for source in value for found in [data_source(source["path"], "")]]


def training_prompts_line(data: list[DataSource]) -> str:
    """The card's line on the training prompts."""
    return f"- Training prompts: {'; '.join(d.described for d in data)}, continued by the verifier (align trajectories)."


def model_card(config: dict[str, Any], meta: dict[str, Any], evaluation: Optional[dict[str, Any]], recipe: Recipe,
               command: str, base_model: str) -> str:
    """README.md of an align-format export. `base_model`: the drafter it was trained from (meta.json's
    drafter_base), or the exported drafter itself when align did not train it (no meta.json)."""
    spec = config.get("drafter_spec", {})
    trained_with = meta.get("verifier")  # the training run's verifier, when its path still resolves here
    usable = trained_with and (Path(trained_with).is_dir() or is_hub_id(trained_with))
    base, verifier = origin(base_model), origin(trained_with if usable else recipe.verifier.path)
    trained = bool(meta)
    data = training_data(meta) if trained else None
    name = title(recipe, f"{base.short} aligned to {verifier.short}" if trained
                 else f"{base.short}, a diffusion drafter for {verifier.short}")
    licence_ = licence(recipe, base)
    results = eval_results(evaluation, recipe.drafter.path, verifier) if evaluation else []
    front = front_matter(title=name, base=base, relation="finetune" if trained else None, licence_=licence_,
                         library="transformers", tags=["speculative-decoding", "diffusion-drafter", "align"],
                         datasets=[d.hub_id for d in data or [] if d.hub_id], results=results)
    body = [
        f"# {name}", "",
        f"A discrete-diffusion drafter for speculative decoding with **{verifier.hub_id or verifier.name}** as the "
        + (f"verifier, aligned with align from {base.markdown()}." if trained
           else f"verifier: {base.markdown()}, exported by align with its DrafterSpec."), "",
        f"DrafterSpec: mask token id {spec.get('mask_token_id')}, logits shift {spec.get('logits_shift')}, "
        f"attention `{spec.get('attention')}` (stored in `config.json` under `drafter_spec`).", "",
        "## Models and data", "",
        f"- Drafter base: {base.described}" + (" (this folder holds it fine-tuned)." if trained else "."),
        f"- Verifier: {verifier.described}: the model whose output this drafter's decoding reproduces exactly.",
        *([training_prompts_line(data)] if data else []),
        licence_.card_line(), "",
    ]
    if evaluation:
        body += measured_table(evaluation, recipe.drafter.path)
    if meta:
        train = meta.get("recipe", {}).get("train", {})
        losses = ", ".join(f"`{name}` × {weight}" for name, weight in (train.get("losses") or {}).items())
        tuning = f"LoRA r={train['lora_r']}" if train.get("lora_r") else "full fine-tuning"
        metrics = meta.get("metrics", {})
        body += ["## Training", "",
                 f"Step {meta.get('step')} of `{base.hub_id or base.name}`, aligned to the verifier on "
                 f"its own continuations with {losses} (γ = {train.get('gamma')}, {meta.get('world_size')} "
                 f"DeepSpeed processes, ZeRO {train.get('zero_stage')}, {tuning}).",
                 ""]
        if "greedy_streak" in metrics:
            body += [f"Held-out simulated accepted length at the end: greedy streak {metrics['greedy_streak']:.2f}, "
                     f"expected streak {metrics['expected_streak']:.2f} draft tokens per window"
                     + (f"; real τ of SpecDiff greedy decoding on {meta['final_tau_prompts']} held-out prompts "
                        f"{meta['final_tau']:.2f}." if "final_tau" in meta else "."), ""]
    name = recipe.export.push_to_hub or "THIS_FOLDER"
    verifier_ref = verifier_reference(recipe, verifier)
    kind = spec.get("kind", "standalone")
    auto_class = drafter_auto_class(config)
    remote = ", trust_remote_code=True" if config.get("auto_map") else ""
    training = (["`recipe.yaml` in this folder is the resolved recipe that trained the drafter (every default filled "
                 "in):", "", "```bash", "align trajectories recipe.yaml --num_gpus N",
                 "align train recipe.yaml --num_gpus N        # or: deepspeed --num_gpus N align/train.py recipe.yaml"]
                if meta.get("recipe") else ["align did not train this drafter; the commands that measured and exported "
                                            "it:", "", "```bash"])
    body += ["## Reproduce", "", *training,
             *([evaluation["meta"]["command"]] if evaluation and evaluation.get("meta", {}).get("command") else []),
             command, "```", "",
             "## Use", "", how_to_read(config, spec), "", *remote_code_lines(config),
             *(custom_generate_usage(name, auto_class, remote, recipe, verifier_ref) if ships_custom_generate(config)
               else []),
             "With align's lossless runtime (install align from its repository: `pip install -e <align checkout>`; "
             "the PyPI package named `align` is an unrelated project):", "",
             "```python", "import torch", "from transformers import AutoModelForCausalLM, AutoTokenizer"
             + (f", {auto_class}" if auto_class != "AutoModelForCausalLM" else ""),
             *(["import align.drafters.dflash  # registers the DFlash drafter with AutoModel"] if kind == "dflash" else []),
             "from align.decoding.specdiff import specdiff_generate", "from align.drafters.spec import DrafterSpec", "",
             f"drafter = {auto_class}.from_pretrained(\"{name}\"{remote}, dtype=torch.float32)",
             "spec = DrafterSpec(**drafter.config.drafter_spec)",
             f"verifier = AutoModelForCausalLM.from_pretrained(\"{verifier_ref}\", dtype=torch.float32)  # {FLOAT32_WHY}",
             f"ids = AutoTokenizer.from_pretrained(\"{name}\")(\"def add(a, b):\", return_tensors=\"pt\").input_ids",
             "tokens, stats = specdiff_generate(verifier, drafter, spec, ids, gamma=8, max_new_tokens=64)",
             "print(stats.tau)  # tokens per verifier forward; tokens are exactly the verifier's greedy output", "```",
             "", *suffix_index_lines(recipe)]
    return front + "\n".join(body)


def remote_code_lines(config: dict[str, Any]) -> list[str]:
    """The card's word on a drafter that ships its own modelling code (Dream, DiffuCoder, LLaDA), which `align export`
    makes loadable with transformers alone (align/remote_code.py's `write_loader`)."""
    if not any(str(ref).startswith("align_loader.") for ref in (config.get("auto_map") or {}).values()):
        return []
    return ["Its modelling code is the upstream model's own, unchanged, written for transformers 4: config.json's "
            "`auto_map` loads each class through `align_loader.py`, which applies align's shims (`align_shims.py`, "
            "one per transformers 5 change the code meets) and recomputes the rotary buffers transformers 5 leaves "
            "uninitialised, so `AutoModel.from_pretrained(folder, trust_remote_code=True)` works with transformers "
            "alone.", ""]


def suffix_index_lines(recipe: Recipe) -> list[str]:
    """The card's word on suffix_index.npz, which `align export` writes when decode.suffix_corpus is set."""
    if recipe.decode.suffix_corpus is None:
        return []
    return ["`suffix_index.npz` here is SuffixDecoding's index over the verifier's own trajectories: the model-free "
            "candidates align's `suffix` methods draft alone and its union tree verifies with this drafter's in one "
            "forward (`align eval recipe.yaml decode.suffix_corpus=<this folder> "
            "\"eval.methods=[specdiff_ngram_suffix_tree_cost]\"`).", ""]


def ships_custom_generate(config: dict[str, Any]) -> bool:
    """Whether the folder carries custom_generate/generate.py: it decodes standalone drafters that read masks (not
    DFlash drafters, which read the verifier's hidden states, nor DiffusionGemma's encoder-decoder noise canvas)."""
    spec = config.get("drafter_spec", {})
    return (spec.get("kind", "standalone") == "standalone" and spec.get("noise", "mask") == "mask"
            and config.get("model_type") not in CANVAS_DECODER_FAMILIES)


# Why the snippets load the verifier in float32 (transformers' default is the checkpoint's dtype, often bf16).
FLOAT32_WHY = "float32: greedy output identical to the verifier's own"


BF16_CAVEAT = ("In bf16 (or fp16) greedy output is identical up to those numerics: a verifier forward scores γ + 1 "
               "positions where `generate()` scores one, kernels that are not batch-invariant round the two "
               "differently, and a near-tie can flip an argmax (where the table above was measured in bf16, its "
               "exact-match column says how often).")


def verifier_reference(recipe: Recipe, verifier: Origin) -> str:
    """How the card's snippets name the verifier: export.verifier_hub_id, else its Hub id, else a placeholder for
    the reader's own copy of a local verifier (whose path the folder never names)."""
    return recipe.export.verifier_hub_id or verifier.hub_id or "VERIFIER_FOLDER"


def custom_generate_usage(name: str, auto_class: str, remote: str, recipe: Recipe, verifier_ref: str) -> list[str]:
    """The card's first snippet: SpecDiff decoding with transformers alone, through this folder's custom_generate."""
    return ["With `transformers` alone (this folder's `custom_generate/generate.py` runs SpecDiff decoding: greedy "
            "output identical to the verifier's `generate()` in float32, sampling by speculative sampling, so "
            "lossless either way; one prompt at a time):", "",
            "```python", "import torch", "from transformers import AutoModelForCausalLM, AutoTokenizer"
            + (f", {auto_class}" if auto_class != "AutoModelForCausalLM" else ""), "",
            f"drafter = {auto_class}.from_pretrained(\"{name}\"{remote}, dtype=torch.float32)",
            f"verifier = AutoModelForCausalLM.from_pretrained(\"{verifier_ref}\", dtype=torch.float32)  # {FLOAT32_WHY}",
            f"ids = AutoTokenizer.from_pretrained(\"{name}\")(\"def add(a, b):\", return_tensors=\"pt\").input_ids",
            f"out = verifier.generate(ids, assistant_model=drafter, custom_generate=\"{name}\", trust_remote_code=True,",
            f"                        max_new_tokens=64, gamma={recipe.decode.gamma}, return_dict_in_generate=True)",
            "print(out.sequences, out.tau)  # τ: tokens per verifier forward", "```", "",
            "`trust_remote_code=True` lets transformers run `custom_generate/generate.py` (torch and transformers "
            "only; read it first). `gamma` is the number of draft tokens per verifier forward. `do_sample=True` "
            "samples as `generate()` does, with its defaults and every logits processor it builds (`temperature`, "
            "`top_k` (50 when unset), `top_p`, `min_p`, `typical_p`, `repetition_penalty`, `no_repeat_ngram_size`, "
            "`bad_words_ids`, ...); what it cannot reproduce (beams, stop strings, guidance, a `logits_processor` "
            "list) it refuses by name. `union=True` verifies the drafter's tree (`tree_nodes`, 32), the n-gram "
            "continuation of the prompt and output so far and, where this folder has `suffix_index.npz`, "
            "SuffixDecoding's candidates over the verifier's own answers in one tree per forward (align's union tree at "
            "a fixed size; sdpa or eager attention): copied numbers, names and code are kept where the drafter is "
            "weak, still lossless.", "", BF16_CAVEAT, ""]


def drafter_auto_class(config: dict[str, Any]) -> str:
    """The transformers Auto class that loads the drafter with its LM head (align/models.py `_load` tries the same)."""
    if config.get("model_type") in CANVAS_DECODER_FAMILIES:
        return "AutoModelForImageTextToText"  # DiffusionGemma: AutoModel would build it without its LM head
    auto_map = config.get("auto_map") or {}
    if config.get("drafter_spec", {}).get("kind") == "dflash" or (auto_map and "AutoModelForCausalLM" not in auto_map):
        return "AutoModel"  # DFlash drafters; Dream/DiffuCoder register their LM under AutoModel only
    return "AutoModelForCausalLM"


def how_to_read(config: dict[str, Any], spec: dict[str, Any]) -> str:
    """One paragraph: how the drafter proposes a block, for its kind (the card's "Use" section)."""
    if spec.get("kind") == "dflash":
        return ("A DFlash-style drafter: it denoises `[last accepted token] ⊕ mask×(b−1)` in one forward, conditioned "
                "on the verifier's hidden states at `aux_hidden_state_layer_ids`, with the verifier's embeddings and "
                "LM head. To serve it in vLLM, export it with `export.format=speculators`.")
    fill = ("one fixed uniform random draw (`noise_fill`, seed `noise_seed`), the noise it was trained to denoise"
            if spec.get("noise") == "uniform" else "`mask_token_id`")
    return (f"`config.drafter_spec` says how to draft: fill γ positions after the context with {fill} and read their "
            "logits (shifted by `logits_shift`).")


def measured_table(evaluation: dict[str, Any], drafter_path: str) -> list[str]:
    """The card's table from eval.json: the baselines, and the exported drafter's rows. When eval.json compared it
    with another drafter in the same run (eval.compare_drafters, e.g. before/after alignment), the other's τ is shown
    beside it."""
    m = evaluation.get("meta", {})
    methods = evaluation["methods"]
    suffix = _rows_of(evaluation, drafter_path)
    before = origin(m["drafter"]).name if suffix and m.get("drafter") else None  # its name, not its path
    header = "| method | τ (tokens per verifier forward) | speedup | exact match with AR greedy |"
    rule = "|---|---|---|---|"
    if before:
        header, rule = header + f" τ with `{before}` |", rule + "---|"
    prompts = data_source(m.get("prompts"), "tiny test split")
    lines = [f"## Measured ({m.get('num_prompts', '?')} prompts from {prompts.described}, temperature 0, on "
             f"{hardware(m.get('machine') or {})}; speedup vs the {m.get('baseline', 'AR baseline')})", "",
             header, rule]
    for name, r in methods.items():
        drafted = name.startswith("specdiff")  # a diffusion-drafter method: one row per drafter compared
        row = methods.get(name + suffix) if drafted else r
        if "@" in name or row is None:
            continue  # other drafters' rows
        line = f"| {name} | {row['tau']:.2f} | {row['speedup']:.2f}× | {row['exact_match']} |"
        if before:
            line += f" {r['tau']:.2f} |" if drafted else " — |"
        lines.append(line)
    return lines + ["", exact_match_line(m), ""]


def exact_match_line(meta: dict[str, Any]) -> str:
    """What the table's exact match means, from eval.json's exact_match_semantics (schema 3), else its machine."""
    semantics = meta.get("exact_match_semantics")
    if semantics:
        return (f"Exact match: the fraction of prompts whose output equals AR greedy's, measured on "
                f"{semantics['device']} in {semantics['dtype']}: {semantics['guarantee']}.")
    machine = meta.get("machine") or {}
    return (f"Exact match: the fraction of prompts whose output equals AR greedy's, measured in "
            f"{machine.get('dtype', 'the dtype eval ran in')} (in float32 identity is exact; in bf16 it holds up to "
            "bf16's numerics).")


def speculators_card(config: dict[str, Any], meta: dict[str, Any], evaluation: Optional[dict[str, Any]],
                     recipe: Recipe, command: str) -> str:
    """README.md of a speculators-format export. Its base model is the verifier: the folder carries the verifier's
    embeddings and LM head, so their licence is the folder's (unless export.license says otherwise)."""
    name = recipe.export.push_to_hub or "THIS_FOLDER"
    k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    verifier = origin(recipe.verifier.path)
    verifier_ref = verifier_reference(recipe, verifier)
    data = training_data(meta) if meta else None
    heading = title(recipe, f"DFlash drafter for {verifier.short}")
    licence_ = licence(recipe, verifier)
    results = eval_results(evaluation, recipe.drafter.path, verifier) if evaluation else []
    front = front_matter(title=heading, base=verifier, relation=None, licence_=licence_, library="speculators",
                         tags=["speculative-decoding", "dflash", "speculators", "align"],
                         datasets=[d.hub_id for d in data or [] if d.hub_id], results=results)
    body = [
        f"# {heading}", "",
        f"A DFlash-style block-diffusion drafter for **{verifier.hub_id or verifier.name}**, trained with align, in the "
        "`speculators` format: one forward denoises `[anchor] ⊕ MASK×(block_size−1)` conditioned on the verifier's "
        f"hidden states entering layers {config['aux_hidden_state_layer_ids']} (projected by `fc`), with the "
        f"verifier's embeddings and LM head (copied in). Block size {config['block_size']}, mask token id "
        f"{config['mask_token_id']}, {config['transformer_layer_config']['num_hidden_layers']} draft layer(s).", "",
        "## Models and data", "",
        f"- Verifier (and base model: its embeddings and LM head are in this folder): {verifier.described}.",
        *([training_prompts_line(data)] if data else []),
        licence_.card_line(), "",
    ]
    if evaluation:
        body += measured_table(evaluation, recipe.drafter.path)
    if meta.get("final_tau") is not None:
        body += [f"align's real τ of SpecDiff greedy decoding on {meta.get('final_tau_prompts')} held-out prompts at "
                 f"the end of training: {meta['final_tau']:.2f}.", ""]
    body += ["## Serve with vLLM", "",
             "`\"method\": \"dflash\"` is needed unless the drafter's path contains `dflash` (vLLM 0.32 guesses the "
             "method from the path, and runs any other as a standalone draft model).", "",
             *([f"{k} draft tokens a step of the {config['block_size'] - 1} its blocks draft (the folder's "
                "`speculative_tokens`, chosen at export): fewer tokens to verify per request keep the drafter from "
                "slowing a server whose batches are full.", ""] if k < config["block_size"] - 1 else []),
             "```bash", f"vllm serve {verifier_ref} --speculative-config "
             f"'{{\"method\": \"dflash\", \"model\": \"{name}\", \"num_speculative_tokens\": {k}}}'", "```", "",
             "```python", "from vllm import LLM, SamplingParams", "",
             'if __name__ == "__main__":  # the engine runs in a child process',
             f"    llm = LLM(model=\"{verifier_ref}\", speculative_config={{\"method\": \"dflash\", "
             f"\"model\": \"{name}\", \"num_speculative_tokens\": {k}}},",
             "              # a 1 GiB KV cache: on a CPU vLLM otherwise reserves 92% of the memory, and refuses to",
             "              # start when less is free (on a GPU, drop it to let vLLM size the cache)",
             "              kv_cache_memory_bytes=1 << 30)",
             "    print(llm.generate([\"def add(a, b):\"], SamplingParams(temperature=0, max_tokens=64)))", "```", "",
             "With align's lossless runtime instead: `align.drafters.speculators_format.load_speculators_dflash(folder)` "
             "gives the drafter back, `align.drafters.spec.drafter_spec_from_config(drafter.config)` the DrafterSpec it is "
             "read by, and `align.decoding.specdiff.specdiff_generate(verifier, drafter, spec, ids, gamma, n)` decodes with both.",
             "", *suffix_index_lines(recipe), "## Reproduce", "", "```bash",
             *([meta["command"]] if meta.get("command") else []), command, "```", ""]
    return front + "\n".join(body)
