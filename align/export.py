"""`align export`: a Hub-ready folder for an aligned drafter, with the numbers that justify it; optionally pushed.

The folder holds the merged weights, `config.json` with the DrafterSpec under `drafter_spec`, the tokenizer,
`draft_graph.json` when a Spiffy graph was calibrated, `eval.json`, and a model card whose table comes from eval.json.
It loads with `transformers` alone. Pushing uses `huggingface_hub`; the local folder is written first and kept
whatever happens to the upload.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

from align.checkpoint import atomic_folder
from align.config import CANVAS_DECODER_FAMILIES, Recipe, RecipeError, check_file, check_inputs, hub_offline

EXIT_UPLOAD_FAILED = 1


def hub_token() -> Optional[str]:
    from huggingface_hub import get_token

    return get_token()


def check_push(recipe: Recipe) -> None:
    """Refuse a push that cannot happen, before any work."""
    if recipe.export.push_to_hub is None:
        return
    if hub_offline():
        raise RecipeError("export.push_to_hub: the Hub is offline (HF_HUB_OFFLINE=1); unset it to push")
    if not hub_token():
        raise RecipeError("export.push_to_hub: no Hugging Face token: set HF_TOKEN or run `hf auth login`")


def model_card(config: dict[str, Any], meta: dict[str, Any], evaluation: Optional[dict[str, Any]], recipe: Recipe,
               command: str, base_model: str) -> str:
    spec = config.get("drafter_spec", {})
    front = [
        "---", f"license: {recipe.export.license}", "library_name: transformers", "pipeline_tag: text-generation",
        f"base_model: {base_model}", "tags:", "- speculative-decoding", "- diffusion-drafter", "- align", "---", "",
    ]
    body = [
        f"# {recipe.export.push_to_hub or Path(recipe.export.out).name}", "",
        f"A discrete-diffusion drafter for speculative decoding with **{recipe.verifier.path}** as the verifier, "
        f"aligned with align from `{base_model}`.", "",
        f"DrafterSpec: mask token id {spec.get('mask_token_id')}, logits shift {spec.get('logits_shift')}, "
        f"attention `{spec.get('attention')}` (stored in `config.json` under `drafter_spec`).", "",
    ]
    if evaluation:
        body += measured_table(evaluation, recipe.drafter.path)
    if meta:
        train = meta.get("recipe", {}).get("train", {})
        losses = ", ".join(f"`{name}` × {weight}" for name, weight in (train.get("losses") or {}).items())
        tuning = f"LoRA r={train['lora_r']}" if train.get("lora_r") else "full fine-tuning"
        metrics = meta.get("metrics", {})
        body += ["## Training", "",
                 f"Step {meta.get('step')} of `{meta.get('drafter_base', base_model)}`, aligned to the verifier on "
                 f"its own continuations with {losses} (γ = {train.get('gamma')}, {meta.get('world_size')} "
                 f"DeepSpeed processes, ZeRO {train.get('zero_stage')}, {tuning}).",
                 ""]
        if "greedy_streak" in metrics:
            body += [f"Held-out simulated accepted length at the end: greedy streak {metrics['greedy_streak']:.2f}, "
                     f"expected streak {metrics['expected_streak']:.2f} draft tokens per window"
                     + (f"; real τ of SpecDiff greedy decoding on {meta['final_tau_prompts']} held-out prompts "
                        f"{meta['final_tau']:.2f}." if "final_tau" in meta else "."), ""]
    name = recipe.export.push_to_hub or "THIS_FOLDER"
    kind = spec.get("kind", "standalone")
    auto_class = drafter_auto_class(config)
    remote = ", trust_remote_code=True" if config.get("auto_map") else ""
    body += ["## Reproduce", "",
             "`recipe.yaml` in this folder is the resolved recipe that trained the drafter (every default filled in):",
             "", "```bash", "align trajectories recipe.yaml --num_gpus N",
             "align train recipe.yaml --num_gpus N        # or: deepspeed --num_gpus N align/train.py recipe.yaml",
             *([evaluation["meta"]["command"]] if evaluation and evaluation.get("meta", {}).get("command") else []),
             command, "```", "",
             "## Use", "", how_to_read(config, spec), "",
             *(custom_generate_usage(name, auto_class, remote, recipe) if ships_custom_generate(config) else []),
             "With align's lossless runtime (install align from its repository: `pip install -e <align checkout>`; "
             "the PyPI package named `align` is an unrelated project):", "",
             "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer"
             + (f", {auto_class}" if auto_class != "AutoModelForCausalLM" else ""),
             *(["import align.dflash  # registers the DFlash drafter with AutoModel"] if kind == "dflash" else []),
             "from align.decoding.specdiff import specdiff_generate", "from align.models import DrafterSpec", "",
             f"drafter = {auto_class}.from_pretrained(\"{name}\"{remote})",
             "spec = DrafterSpec(**drafter.config.drafter_spec)",
             f"verifier = AutoModelForCausalLM.from_pretrained(\"{recipe.verifier.path}\")",
             f"ids = AutoTokenizer.from_pretrained(\"{name}\")(\"def add(a, b):\", return_tensors=\"pt\").input_ids",
             "tokens, stats = specdiff_generate(verifier, drafter, spec, ids, gamma=8, max_new_tokens=64)",
             "print(stats.tau)  # tokens per verifier forward; tokens are exactly the verifier's greedy output", "```",
             ""]
    return "\n".join(front + body)


def ships_custom_generate(config: dict[str, Any]) -> bool:
    """Whether the folder carries custom_generate/generate.py: it decodes standalone drafters that read masks (not
    DFlash drafters, which read the verifier's hidden states, nor DiffusionGemma's encoder-decoder noise canvas)."""
    spec = config.get("drafter_spec", {})
    return (spec.get("kind", "standalone") == "standalone" and spec.get("noise", "mask") == "mask"
            and config.get("model_type") not in CANVAS_DECODER_FAMILIES)


def custom_generate_usage(name: str, auto_class: str, remote: str, recipe: Recipe) -> list[str]:
    """The card's first snippet: SpecDiff decoding with transformers alone, through this folder's custom_generate."""
    return ["With `transformers` alone (this folder's `custom_generate/generate.py` runs SpecDiff decoding: greedy "
            "output identical to the verifier's `generate()`, sampling by speculative sampling, so lossless either "
            "way; one prompt at a time):", "",
            "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer"
            + (f", {auto_class}" if auto_class != "AutoModelForCausalLM" else ""), "",
            f"drafter = {auto_class}.from_pretrained(\"{name}\"{remote})",
            f"verifier = AutoModelForCausalLM.from_pretrained(\"{recipe.verifier.path}\")",
            f"ids = AutoTokenizer.from_pretrained(\"{name}\")(\"def add(a, b):\", return_tensors=\"pt\").input_ids",
            f"out = verifier.generate(ids, assistant_model=drafter, custom_generate=\"{name}\", trust_remote_code=True,",
            f"                        max_new_tokens=64, gamma={recipe.decode.gamma}, return_dict_in_generate=True)",
            "print(out.sequences, out.tau)  # τ: tokens per verifier forward", "```", "",
            "`trust_remote_code=True` lets transformers run `custom_generate/generate.py` (torch and transformers "
            "only; read it first). `gamma` is the number of draft tokens per verifier forward; `do_sample=True` "
            "with `temperature`, `top_k`, `top_p` samples.", ""]


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
    labels = {label: path for label, path in (m.get("compare_drafters") or {}).items()
              if Path(path).resolve() == Path(drafter_path).resolve()}
    suffix = f"@{next(iter(labels))}" if labels else ""
    before = m.get("drafter") if suffix else None
    header = "| method | τ (tokens per verifier forward) | speedup | exact match with AR greedy |"
    rule = "|---|---|---|---|"
    if before:
        header, rule = header + f" τ with `{before}` |", rule + "---|"
    lines = [f"## Measured ({m.get('num_prompts', '?')} prompts from {m.get('prompts', '?')}, temperature 0, "
             f"{m.get('machine', {}).get('processor', '?')}; speedup vs the {m.get('baseline', 'AR baseline')})", "",
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
    return lines + [""]


def copy_run_records(recipe: Recipe, source: Path, tmp: Path) -> tuple[Optional[dict[str, Any]], dict[str, Any]]:
    """Copy export.eval (as eval.json) and the training run's resolved recipe (as recipe.yaml) into the folder;
    return the evaluation and the checkpoint's meta.json (empty when the drafter was not trained by align)."""
    evaluation = None
    if recipe.export.eval:
        evaluation = json.loads(Path(recipe.export.eval).read_text())
        shutil.copy2(recipe.export.eval, tmp / "eval.json")
    meta = json.loads((source / "meta.json").read_text()) if (source / "meta.json").is_file() else {}
    if meta.get("recipe"):
        import yaml

        (tmp / "recipe.yaml").write_text(yaml.safe_dump(meta["recipe"], sort_keys=False))
    return evaluation, meta


def build_folder(recipe: Recipe, command: str, out: Path) -> None:
    """Write the export folder atomically: a previous export stays until the new one is complete."""
    source = Path(recipe.drafter.path)
    if (source / "adapter_config.json").is_file():
        raise RecipeError(f"drafter.path: {source} is a LoRA adapter; export a merged step_<N> folder from align train")
    with atomic_folder(out) as tmp:
        if recipe.export.format == "speculators":
            fill_speculators_folder(recipe, command, source, tmp)
        else:
            fill_folder(recipe, command, source, tmp)


def fill_speculators_folder(recipe: Recipe, command: str, source: Path, tmp: Path) -> None:
    """A DFlash drafter as speculators saves one: config.json (speculators_config, aux_hidden_state_layer_ids,
    mask_token_id, block_size), model.safetensors under vLLM's qwen3_dflash weight names with the verifier's
    embeddings and LM head copied in, the tokenizer, and a card that says how to serve it."""
    from align.dflash import write_speculators_folder
    from align.models import is_dflash, load_drafter, load_tokenizer, load_verifier

    tokenizer = load_tokenizer(str(source))
    drafter, _ = load_drafter(recipe.drafter, tokenizer)
    if not is_dflash(drafter):
        raise RecipeError(f"export.format: speculators takes a DFlash drafter; {source} is a standalone diffusion "
                          "drafter (export.format=align)")
    config = write_speculators_folder(drafter, load_verifier(recipe.verifier), recipe.verifier.path, tokenizer, tmp)
    evaluation, meta = copy_run_records(recipe, source, tmp)
    (tmp / "README.md").write_text(speculators_card(config, meta, evaluation, recipe, command))


def speculators_card(config: dict[str, Any], meta: dict[str, Any], evaluation: Optional[dict[str, Any]],
                     recipe: Recipe, command: str) -> str:
    name = recipe.export.push_to_hub or "THIS_FOLDER"
    k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    front = ["---", f"license: {recipe.export.license}", "library_name: speculators",
             f"base_model: {recipe.verifier.path}", "tags:", "- speculative-decoding", "- dflash", "- speculators",
             "- align", "---", ""]
    body = [
        f"# {recipe.export.push_to_hub or Path(recipe.export.out).name}", "",
        f"A DFlash-style block-diffusion drafter for **{recipe.verifier.path}**, trained with align, in the "
        "`speculators` format: one forward denoises `[anchor] ⊕ MASK×(block_size−1)` conditioned on the verifier's "
        f"hidden states entering layers {config['aux_hidden_state_layer_ids']} (projected by `fc`), with the "
        f"verifier's embeddings and LM head (copied in). Block size {config['block_size']}, mask token id "
        f"{config['mask_token_id']}, {config['transformer_layer_config']['num_hidden_layers']} draft layer(s).", "",
    ]
    if evaluation:
        body += measured_table(evaluation, recipe.drafter.path)
    if meta.get("final_tau") is not None:
        body += [f"align's real τ of SpecDiff greedy decoding on {meta.get('final_tau_prompts')} held-out prompts at "
                 f"the end of training: {meta['final_tau']:.2f}.", ""]
    body += ["## Serve with vLLM", "",
             "`\"method\": \"dflash\"` is needed unless the drafter's path contains `dflash` (vLLM 0.32 guesses the "
             "method from the path, and runs any other as a standalone draft model).", "",
             "```bash", f"vllm serve {recipe.verifier.path} --speculative-config "
             f"'{{\"method\": \"dflash\", \"model\": \"{name}\", \"num_speculative_tokens\": {k}}}'", "```", "",
             "```python", "from vllm import LLM, SamplingParams", "",
             'if __name__ == "__main__":  # the engine runs in a child process',
             f"    llm = LLM(model=\"{recipe.verifier.path}\", speculative_config={{\"method\": \"dflash\", "
             f"\"model\": \"{name}\", \"num_speculative_tokens\": {k}}})",
             "    print(llm.generate([\"def add(a, b):\"], SamplingParams(temperature=0, max_tokens=64)))", "```", "",
             "With align's lossless runtime instead: `align.dflash.load_speculators_dflash(folder)` gives the drafter "
             "back, and `align.decoding.specdiff.specdiff_generate(verifier, drafter, spec, ids, gamma, n)` decodes "
             "with it.", "", "## Reproduce", "", "```bash", *([meta["command"]] if meta.get("command") else []),
             command, "```", ""]
    return "\n".join(front + body)


def fill_folder(recipe: Recipe, command: str, source: Path, tmp: Path) -> None:
    from align.models import drafter_spec_from_config, load_tokenizer

    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("meta.json", "*.tmp"), dirs_exist_ok=True)
    config = json.loads((tmp / "config.json").read_text())
    if "drafter_spec" not in config:
        from transformers import AutoConfig

        remote = recipe.drafter.trust_remote_code  # Dream, DiffuCoder, LLaDA: their config class ships with them
        spec = drafter_spec_from_config(AutoConfig.from_pretrained(source, trust_remote_code=remote),
                                        load_tokenizer(str(source), remote),
                                        recipe.drafter.mask_token_id, recipe.drafter.logits_shift,
                                        recipe.drafter.attention)
        config["drafter_spec"] = spec.to_dict()
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if recipe.calibrate.graph:
        shutil.copy2(recipe.calibrate.graph, tmp / "draft_graph.json")
    if ships_custom_generate(config):
        # transformers' Hub mechanism for decoding loops: SpecDiff from this folder with transformers alone.
        (tmp / "custom_generate").mkdir()
        shutil.copy2(Path(__file__).with_name("custom_generate.py"), tmp / "custom_generate" / "generate.py")
    evaluation, meta = copy_run_records(recipe, source, tmp)
    base_model = meta.get("drafter_base") or str(source)
    (tmp / "README.md").write_text(model_card(config, meta, evaluation, recipe, command, base_model))


def push(folder: Path, recipe: Recipe) -> None:
    from huggingface_hub import HfApi

    e = recipe.export
    api = HfApi()
    api.create_repo(e.push_to_hub, private=e.private, exist_ok=True)
    if e.revision != "main":
        api.create_branch(e.push_to_hub, branch=e.revision, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=e.push_to_hub, revision=e.revision,
                      commit_message=e.commit_message)


def main(recipe: Recipe, command: str) -> None:
    # The speculators format carries the verifier's embeddings and LM head, and names it as the drafter's verifier.
    speculators = ("verifier.path",) if recipe.export.format == "speculators" else ()
    check_inputs(recipe, model_keys=("drafter.path", *speculators))
    check_file("calibrate.graph", recipe.calibrate.graph)
    check_file("export.eval", recipe.export.eval)
    check_push(recipe)
    out = Path(recipe.export.out)
    build_folder(recipe, command, out)
    print(f"export: {out}")
    if recipe.export.push_to_hub is None:
        return
    try:
        push(out, recipe)
    except Exception as e:  # the upload can fail in many ways (network, permissions, quota); all end the same way
        print(f"align export: upload to {recipe.export.push_to_hub} failed ({type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}); the folder {out} is intact: rerun the same command to "
              "retry", file=sys.stderr)
        raise SystemExit(EXIT_UPLOAD_FAILED) from None
    print(f"export: pushed to {recipe.export.push_to_hub} ({recipe.export.revision})")
