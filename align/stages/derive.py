"""`align derive`: a standalone block-diffusion drafter cut from the verifier's own weights (the Dream/DiffuCoder
recipe in miniature), ready for `align train` to align and `align eval` to draft with (drafter.path=<derive.out>).

1. Built from the verifier: its config with fewer layers and a `drafter_spec` (mask token, logits shift 1,
   block-causal attention), then its embeddings, the kept layers, its final norm and LM head (tied as the verifier's
   are) copied in. The tokenizer is the verifier's, unchanged: the mask token is one align chooses for it
   (align/drafters/mask_token.py; SmolLM2's `<empty_output>`, id 16) and says, in the output and the manifest.
2. Adapted with the MDLM objective (align/pretraining.py, the loop and step `align bootstrap` pretrains its drafter
   with) for a step budget, resumable: a killed run resumes from its last saved state.
3. Written atomically, with a manifest: the loss on held-out text before and after adaptation, steps/s, the kept
   layers, the mask token and where the text came from.

The text: the verifier's own trajectories (trajectories.out, written by `align trajectories`), not `align prompts`'
prompts. A drafter drafts the verifier's answers after chat-templated prompts; the trajectories are exactly that text
(prompt ⊕ the verifier's completion, rendered as every stage renders them), where the prompts alone are user turns, a
distribution the drafter never drafts. `align train` reads the same folder next, and its held-out prompts are held out
here too. Their prompts are the recipe's training prompts (Magpie prompts in recipes/smollm2: no benchmark item);
trajectories of the recipe's own eval.prompts are refused.

`derive.drafter=ar` cuts an autoregressive drafter the same way (no mask token, no drafter spec) and adapts it with
next-token cross-entropy on the same text: the AR baseline HF assisted generation and align's sd_ar run with
(ar_drafter.path), built as the diffusion drafter is, so that the two are compared on equal terms.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from align.config import Recipe, RecipeError
from align.config_inputs import DeriveSection
from align.data import HELD_OUT_EVERY  # the drafter is not adapted on the prompts align train measures it on
from align.drafters.spec import DrafterSpec
from align.provenance import installed_versions

MANIFEST = "manifest.json"
# The layout of the folder align derive writes: bumped when it changes, so older folders are derived again.
FORMAT = 1


@dataclass(frozen=True)
class Plan:
    """What a run would build, read from configs and manifests only (no weights)."""

    layers: list[int]
    verifier_layers: int
    spec: Optional[DrafterSpec]  # None: an AR drafter
    mask_token: Optional[str]  # how the mask token was chosen, said and kept in the manifest
    trajectories: dict[str, Any]  # the trajectories' manifest
    config_hash: str
    cached: bool  # derive.out already holds this drafter


def kept_layers(d: DeriveSection, num_layers: int) -> list[int]:
    """The verifier layers the drafter keeps: derive.layers, else derive.num_layers of them evenly spread from the
    first to the last (30 layers, 4 kept: [0, 10, 19, 29]; one kept: the last)."""
    if d.layers is not None:
        outside = [i for i in d.layers if i >= num_layers]
        if outside:
            raise RecipeError(f"derive.layers: {outside} are not layers of the verifier, which has {num_layers} "
                              f"(0 to {num_layers - 1})")
        return list(d.layers)
    if d.num_layers >= num_layers:
        raise RecipeError(f"derive.num_layers: {d.num_layers} keeps every one of the verifier's {num_layers} layers; a "
                          "drafter is cheaper than its verifier, so keep fewer")
    if d.num_layers == 1:
        return [num_layers - 1]
    return [round(i * (num_layers - 1) / (d.num_layers - 1)) for i in range(d.num_layers)]


def _read_manifest(out: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def plan(recipe: Recipe) -> Plan:
    """Everything checked before any weights load: the layers, the mask token, the context, the trajectories (made by
    this verifier, with this chat template, of prompts that are not the eval's). Raises RecipeError."""
    from align.checkpoint import drafter_identity
    from align.data import check_trajectories_match, read_trajectory_manifest, recipe_chat_template, _same_path
    from align.drafters.mask_token import choose_mask_token
    from align.models import load_tokenizer
    from align.preflight import context_length, load_model_config

    d = recipe.derive
    config = load_model_config("verifier.path", recipe.verifier).get_text_config()
    layers = kept_layers(d, int(config.num_hidden_layers))
    if d.seq_len > context_length(config):
        raise RecipeError(f"derive.seq_len: {d.seq_len} exceeds the verifier's context ({context_length(config)} "
                          "tokens)")
    tokenizer = load_tokenizer(recipe.verifier.path, recipe.verifier.trust_remote_code)
    template = recipe_chat_template(recipe, "verifier.path")
    if d.drafter == "ar":
        if d.mask_token_id is not None:
            raise RecipeError("derive.mask_token_id: an AR drafter (derive.drafter=ar) has no mask token; leave it "
                              "unset")
        spec, how = None, None
    else:
        mask_id, how = choose_mask_token(tokenizer, int(config.vocab_size), template, d.mask_token_id,
                                         key="derive.mask_token_id")
        spec = DrafterSpec(mask_id, d.logits_shift, d.attention)
    made = read_trajectory_manifest(recipe.trajectories.out)
    check_trajectories_match(recipe, made)
    if recipe.eval.prompts is not None and _same_path(str(made.get("prompts")), recipe.eval.prompts):
        raise RecipeError(f"trajectories.out: the trajectories in {recipe.trajectories.out} are of eval.prompts "
                          f"({recipe.eval.prompts}); a drafter adapted on the benchmark it is measured on is measured "
                          "on its training data. Make trajectories of training prompts (align prompts)")
    settings = {
        "format": FORMAT, "verifier": drafter_identity(recipe.verifier.path), "layers": layers,
        "spec": spec.to_dict() if spec else None, "trajectories": made.get("settings_hash"),
        # what changes the result; where it is written, how often it is saved and how many threads do not
        **{k: v for k, v in d.model_dump(mode="json").items()
           if k not in ("out", "threads", "save_every_minutes", "force", "layers", "num_layers", "mask_token_id")},
    }
    settings["verifier"] = {k: settings["verifier"][k] for k in ("resolved", "weights_sha256")}
    config_hash = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    manifest = _read_manifest(Path(d.out)) or {}
    cached = not d.force and manifest.get("stage") == "derive" and manifest.get("config_hash") == config_hash
    return Plan(layers, int(config.num_hidden_layers), spec, how, made, config_hash, cached)


def models(recipe: Recipe) -> tuple[str, ...]:
    return ("verifier.path",)


def check(recipe: Recipe) -> None:
    """align derive's checks before any work (the CLI runs it, align/stages/__init__.py)."""
    plan(recipe)


# --------------------------------------------------------------------------------------------------------------------
# building and adapting
# --------------------------------------------------------------------------------------------------------------------
_LAYER_KEY = re.compile(r"^(.*\.layers\.)(\d+)(\..*)$")


def build_drafter(verifier: Any, layers: list[int], spec: Optional[DrafterSpec]) -> Any:
    """A drafter from `verifier` (a transformers causal LM): its config with `len(layers)` layers and `drafter_spec`
    (a block-diffusion drafter; None: an AR one, the verifier's own architecture), every weight copied (the layers in
    `layers`, renumbered 0..k-1 in that order), embeddings tied as the verifier's. Built from its config rather than
    by deleting layers, so that each attention layer's cache index is its new position."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(verifier.config)
    text = config.get_text_config()
    if getattr(text, "layer_types", None):  # Qwen2, Gemma: the kept layers keep their attention types
        text.layer_types = [text.layer_types[i] for i in layers]
    text.num_hidden_layers = len(layers)
    if spec is not None:
        config.drafter_spec = spec.to_dict()
    drafter = AutoModelForCausalLM.from_config(config, dtype=verifier.dtype)
    state = {}
    for name, tensor in verifier.state_dict().items():
        found = _LAYER_KEY.match(name)
        if found:
            if int(found.group(2)) not in layers:
                continue
            name = f"{found.group(1)}{layers.index(int(found.group(2)))}{found.group(3)}"
        state[name] = tensor
    drafter.load_state_dict(state, strict=True)  # every weight of the drafter is the verifier's
    return drafter


def token_stream(rows: Any, indices: list[int]) -> "Any":
    """The trajectories at `indices`, each prompt ⊕ completion, as one int32 stream (np.ndarray). The prompts start
    with the chat template's own turn markers, which separate the conversations (as end-of-text separates
    bootstrap's files)."""
    import numpy as np

    prompts, completions = rows["prompt_ids"], rows["completion_ids"]
    return np.fromiter((t for i in indices for t in (*prompts[i], *completions[i])), dtype=np.int32)


def main(recipe: Recipe, command: str) -> int:
    d = recipe.derive
    t0 = time.perf_counter()
    p = plan(recipe)
    out = Path(d.out)
    if p.cached:
        print(f"derive: {out} is up to date (its manifest matches the recipe); derive.force=true builds it again")
        return 0
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from align.checkpoint import save_merged
    from align.disk import mark_folder, verify_checksums
    from align.data import load_checked_trajectories
    from align.models import load_tokenizer
    from align.pretraining import (Schedule, leading_windows, mdlm_step, mean_loss, next_token_step, random_windows,
                                   train_loop, use_bf16)

    rows = load_checked_trajectories(recipe)
    held = [i for i, k in enumerate(rows["prompt_index"]) if k % HELD_OUT_EVERY == 0]
    train = [i for i, k in enumerate(rows["prompt_index"]) if k % HELD_OUT_EVERY != 0]
    streams = {"train": token_stream(rows, train), "held_out": token_stream(rows, held)}
    for split, stream in streams.items():  # every check before the first write
        if len(stream) < d.seq_len + 2:
            raise RecipeError(f"derive.seq_len: the {split.replace('_', '-')} trajectories in "
                              f"{recipe.trajectories.out} hold {len(stream)} tokens, fewer than one sequence of "
                              f"{d.seq_len} + 1; make trajectories of more prompts, or lower derive.seq_len")
    mark_folder(out, "derive")
    if d.threads:
        torch.set_num_threads(d.threads)
    bf16 = use_bf16(d.precision)
    if Path(recipe.verifier.path).is_dir():
        verify_checksums(recipe.verifier.path, "verifier.path")
    tokenizer = load_tokenizer(recipe.verifier.path, recipe.verifier.trust_remote_code)
    token = tokenizer.convert_ids_to_tokens(p.spec.mask_token_id) if p.spec else None
    objective = "MDLM" if p.spec else "next-token"
    kind = f"the mask token is {p.mask_token}" if p.spec else "an AR drafter"
    print(f"derive: layers {p.layers} of the verifier's {p.verifier_layers}; {kind}; "
          f"{len(streams['train']):,} training tokens ({len(train)} trajectories), {len(streams['held_out']):,} "
          f"held out; {'bf16' if bf16 else 'fp32'}; {d.max_steps} steps -> {out}")
    # float32 for training whatever the verifier is stored in; the drafter is saved in the verifier's own dtype
    stored = getattr(AutoConfig.from_pretrained(recipe.verifier.path, trust_remote_code=recipe.verifier.trust_remote_code),
                     "dtype", None)
    saved_dtype = stored if isinstance(stored, torch.dtype) else getattr(torch, str(stored), torch.float32)
    verifier = AutoModelForCausalLM.from_pretrained(recipe.verifier.path, dtype=torch.float32,
                                                    trust_remote_code=recipe.verifier.trust_remote_code)
    torch.manual_seed(d.seed)
    drafter = build_drafter(verifier, p.layers, p.spec)
    del verifier
    if not d.train_embeddings:
        drafter.get_input_embeddings().requires_grad_(False)
        drafter.get_output_embeddings().requires_grad_(False)
    sizes = d.block_sizes

    def step_fn(model: Any, window: Any, gen: Any, step: int) -> Any:
        if p.spec is None:
            return next_token_step(model, window)
        return mdlm_step(model, window, gen, p.spec.mask_token_id, sizes[step % len(sizes)], p.spec.logits_shift)

    held_out = leading_windows(streams["held_out"], d.seq_len, d.eval_tokens, d.batch_size)
    before = mean_loss(drafter, step_fn, held_out, bf16)
    print(f"derive: held-out {objective} loss before adaptation {before:.3f} nats/token")
    schedule = Schedule(d.lr, d.warmup_steps, d.min_lr_ratio, d.weight_decay, d.save_every_minutes,
                        max_steps=d.max_steps)
    stats = train_loop("derive", drafter, step_fn,
                       lambda rng: random_windows(streams["train"], d.batch_size, d.seq_len, rng),
                       schedule, out / ".work", p.config_hash, d.seed, bf16)
    after = mean_loss(drafter, step_fn, held_out, bf16)
    steps_per_s = stats["steps"] / stats["wall_time_s"] if stats["wall_time_s"] else None
    n_params = sum(t.numel() for t in drafter.parameters())
    manifest = {
        "stage": "derive", "command": command, "config_hash": p.config_hash,
        "verifier": {"path": recipe.verifier.path, "layers": p.verifier_layers},
        "drafter": d.drafter, "layers_kept": p.layers,
        "mask_token": {"id": p.spec.mask_token_id, "token": token, "chosen": p.mask_token} if p.spec else None,
        "drafter_spec": p.spec.to_dict() if p.spec else None, "parameters": n_params,
        "trainable_parameters": sum(t.numel() for t in drafter.parameters() if t.requires_grad),
        "text": {"source": "the verifier's trajectories", "trajectories": recipe.trajectories.out,
                 "settings_hash": p.trajectories.get("settings_hash"), "prompts": p.trajectories.get("prompts"),
                 "train_rows": len(train), "held_out_rows": len(held), "train_tokens": int(len(streams["train"])),
                 "held_out_every": HELD_OUT_EVERY},
        "loss_kind": ("MDLM bound (nats/token) on held-out trajectories, fixed masks" if p.spec else
                      "next-token cross-entropy (nats/token) on held-out trajectories"),
        "held_out_loss_before": before, "held_out_loss_after": after, **stats,
        "steps_per_s": round(steps_per_s, 4) if steps_per_s else None,
        "precision": "bf16" if bf16 else "fp32", "threads": torch.get_num_threads(),
        "settings": recipe.derive.model_dump(mode="json"),
        "versions": installed_versions("align-drafters", "transformers", "torch"),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    files = {MANIFEST: json.dumps(manifest, indent=2)}
    if Path(recipe.verifier.path).is_dir():  # the verifier's licence travels with weights derived from it
        files.update({f.name: f.read_text() for f in sorted(Path(recipe.verifier.path).glob("LICENSE*"))})
    save_merged(drafter.to(saved_dtype), tokenizer, out, files, kind="derive")
    said = f"; mask token {token!r} (id {p.spec.mask_token_id})" if p.spec else "; an AR drafter"
    print(f"derive: {len(p.layers)} layers, {n_params / 1e6:.1f}M parameters; held-out {objective} loss {before:.3f} "
          f"-> {after:.3f} nats/token in {stats['steps']} steps ({steps_per_s or 0:.3f} steps/s){said} -> {out}")
    return 0

