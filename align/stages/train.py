"""`align train`: align a diffusion drafter to a verifier under DeepSpeed, readable top to bottom. Also run by the
script the DeepSpeed launcher runs on every rank (align/train.py):

    align train recipes/tiny/align.yaml [key=value ...] [--num_gpus 2]
    deepspeed --num_gpus 2 align/train.py recipes/tiny/align.yaml [key=value ...]     # the same, launched by hand
    python align/train.py recipes/tiny/align.yaml                                      # 1 process, no launcher

Reads trajectories written by `align trajectories`, trains on windows with the recipe's weighted losses, and writes
`<train.out>/step_<N>/` (a merged HF folder loadable by transformers alone, with meta.json; a LoRA run's holds the
adapter and a checked pointer to its base drafter, merged when read and by `align export`), `ds_state/` (DeepSpeed
state for exact resume) and `metrics.jsonl`, and sends the metrics to the trackers of `train.report_to` (TensorBoard
events in `<train.out>/tensorboard` by default). A re-run resumes from the last checkpoint and reproduces the losses
an uninterrupted run would have had: every batch is a function of (seed, step, rank).
A checkpoint is only ever written from finite weights, so `latest` never points at a poisoned state.
A run resumes only with the settings it was started with (`<train.out>/run.json`; MAY_CHANGE_ON_RESUME lists what may
differ), a finished run says so and does nothing, and the run folder is locked while a run writes it.
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from align.batches import StepBatches, batch_stream, step_batches
from align.checkpoint import (is_adapter_folder, is_lora, save_checkpoint, state_to_resume, step_folders,
                              weights_sha256_of)
from align.config import Recipe, RecipeError, first_line
from align.data import (HELD_OUT_EVERY, TRAJECTORY_MANIFEST, check_rows_fit, load_checked_trajectories, rank_share,
                        read_trajectory_manifest, verify_trajectory_files)
from align.decoding.specdiff import specdiff_generate
from align.dist import (all_ranks, check_shared_folder, collective_timeout, deepspeed_config, init_distributed,
                        spans_machines, watch_peers)
from align.disk import (STEP_FOLDER, append_log, hashes_inputs, mark_folder, read_log, record_checksums,
                        write_text_atomic)
from align.drafters import drafter_for
from align.drafters.dflash import DraftVocab, most_frequent_tokens, set_draft_vocab, verifier_states
from align.drafters.kind import TrainedDrafter, reads_verifier_states
from align.drafters.loading import build_drafter, check_masks_are_read, check_new_dflash, drafter_reads, load_drafter
from align.drafters.spec import CANVAS_DECODER_FAMILIES, DrafterSpec
from align.drafters.states_cache import StatesCache, batch_states
from align.drafters.states_store import StatesStore, check_states, read_states_manifest
from align.losses import (WINDOW_LOSSES, _row_target_log_prob, needs_verifier_distributions, normalisation,
                          rowwise)
from align.memory_probe import peak_per_gpu, warn_train_memory
from align.models import is_partitioned, load_tokenizer, load_verifier, load_verifier_ends
from align.onpolicy import rejection_batch
from align.preflight import drafter_kind, load_model_config
from align.recipe_files import get_key
from align.tracking import check_trackers, open_trackers
from align.windows import (WINDOW_BUILDERS, WindowBatch, topk_window_logits, verifier_path_logits,
                           verifier_window_logits, window_forwards, window_logits)

EXIT_NOT_FINITE = 3
# The recipe sections that define a run, and what in them may change when it resumes: how far it runs (the cosine
# schedule is recomputed for the new length), how often it saves, evaluates and reports, where its run folder is, and
# the devices. Every other key, and the trajectories it reads (their settings hash), would make the resumed run
# continue another run's weights and optimiser state: `align train` refuses it and names the keys.
RUN_SECTIONS = ("drafter", "dflash", "verifier", "train")
MAY_CHANGE_ON_RESUME = frozenset({"train.out", "train.max_steps", "train.save_every", "train.eval_every",
                                  "train.final_eval_prompts", "train.report_to", "train.project", "train.run_name",
                                  "train.keep_last", "train.held_out_max_rows", "train.activation_checkpointing", "train.peer_silence_s",
                                  "drafter.device", "verifier.device"})
RUN_RECORD = "run.json"  # in train.out: the settings the run was started with


@dataclass
class TrainData:
    """The trajectories and how they are split; everything the loop reads besides the models."""

    rows: Any  # datasets.Dataset of trajectories
    train_rows: list[int]
    held_out: list[int]
    online: bool  # the verifier runs in the step (its distributions or labels), rather than reading stored top-k


@dataclass
class Trainer:
    """The DeepSpeed engine and what a step needs beside it."""

    engine: Any
    schedule: Any
    spec: DrafterSpec
    tokenizer: Any
    verifier: Optional[torch.nn.Module]
    build: Callable[..., WindowBatch]
    pad_id: int
    rank: int
    world: int
    device: torch.device  # this rank's (cuda:LOCAL_RANK on GPUs): batches and collective tensors live there
    mask_token: Optional[str] = None  # how a new DFlash drafter's mask token was chosen (kept in each meta.json)
    states: Optional[StatesCache] = None  # train.cache_verifier_states: the rows' verifier states, once computed


# --------------------------------------------------------------------------------------------------------------------
# setup
# --------------------------------------------------------------------------------------------------------------------
def check_data(recipe: Recipe) -> TrainData:
    """Load the trajectories and refuse, before any model is loaded, what cannot train as the recipe says."""
    t = recipe.train
    online = t.labels_online()
    rows = load_checked_trajectories(recipe)
    # A DFlash step has the verifier's exact distributions: it runs the verifier (or reads its cached states) anyway.
    if t.reads_verifier_distributions() and not online and not reads_verifier_states(recipe) \
            and "topk_ids" not in rows.column_names:
        raise RecipeError("train.losses: KD losses need verifier distributions: set train.data_mode=online, or "
                          "trajectories.store_topk > 0 when making the trajectories")
    longest = max(len(c) for c in rows["completion_ids"])
    if t.gamma > longest:
        raise RecipeError(f"train.gamma: {t.gamma} is longer than every completion in {recipe.trajectories.out} "
                          f"(longest {longest} tokens): no window could be filled; use train.gamma <= {longest}")
    # A window drawn at the last completion token reads the n - 1 tokens before it and drafts γ positions after them,
    # in the drafter (a DFlash drafter: the verifier it is built on) and in a verifier that labels it in the step.
    readers = tuple(dict.fromkeys(drafter_reads(recipe) + (("verifier.path",) if online else ())))
    cap = t.max_sequence_length or math.inf  # windows are drawn from the first max_sequence_length tokens only
    check_rows_fit(recipe, [min(len(p) + len(c), cap) - 1 for p, c in zip(rows["prompt_ids"], rows["completion_ids"])],
                   "train.gamma", t.gamma, readers)
    if t.max_sequence_length is not None:
        capped_out = sum(len(p) >= t.max_sequence_length for p in rows["prompt_ids"])
        if capped_out == len(rows):
            raise RecipeError(f"train.max_sequence_length: {t.max_sequence_length} tokens hold no completion token "
                              f"of any trajectory in {recipe.trajectories.out} (shortest prompt "
                              f"{min(len(p) for p in rows['prompt_ids'])} tokens): no window could be drawn")
        if capped_out and int(os.environ.get("RANK", 0)) == 0:
            print(f"align train: warning: train.max_sequence_length={t.max_sequence_length} leaves {capped_out} of "
                  f"{len(rows)} trajectories no window (their prompts fill it)", file=sys.stderr)
    median = statistics.median(len(c) for c in rows["completion_ids"])
    if t.gamma > median and int(os.environ.get("RANK", 0)) == 0:
        print(f"align train: warning: train.gamma={t.gamma} is longer than half the completions (median {median:g} "
              "tokens): their windows are cut short and train fewer positions", file=sys.stderr)
    held_out = [i for i, p in enumerate(rows["prompt_index"]) if p % HELD_OUT_EVERY == 0]
    train_rows = [i for i, p in enumerate(rows["prompt_index"]) if p % HELD_OUT_EVERY != 0]
    if not train_rows:
        raise RecipeError(f"trajectories.out: {recipe.trajectories.out} holds only held-out prompts (one in "
                          f"{HELD_OUT_EVERY} is held out, the first among them); make trajectories of more prompts")
    return TrainData(rows, train_rows, held_out, online)


def run_settings(recipe: dict[str, Any]) -> dict[str, Any]:
    """The keys that define a run (section.key -> value; dflash whole, since its presence decides the drafter), from
    a resolved recipe (Recipe.to_dict(), or the one a checkpoint's meta.json holds). Model paths that exist are made
    absolute: the same folder named from elsewhere is the same run."""
    flat: dict[str, Any] = {}
    for section in RUN_SECTIONS:
        value = recipe.get(section)
        if section == "dflash" or not isinstance(value, dict):
            flat[section] = value
        else:
            flat.update({f"{section}.{key}": v for key, v in value.items()})
    for key in ("drafter.path", "verifier.path"):
        if isinstance(flat.get(key), str) and Path(flat[key]).exists():
            flat[key] = str(Path(flat[key]).resolve())
    return {key: value for key, value in flat.items() if key not in MAY_CHANGE_ON_RESUME}


def trajectory_settings_hash(recipe: Recipe) -> Optional[str]:
    try:
        return json.loads((Path(recipe.trajectories.out) / TRAJECTORY_MANIFEST).read_text()).get("settings_hash")
    except (OSError, ValueError, AttributeError):
        return None  # check_data names a missing or unreadable manifest


def recorded_run(out: Path) -> Optional[dict[str, Any]]:
    """The settings the run in `out` was started with: its run.json, or, for a run from before run.json, the recipe
    in its newest checkpoint's meta.json; None for a new run."""
    try:
        return json.loads((out / RUN_RECORD).read_text())
    except (OSError, ValueError):
        pass
    folders = step_folders(out)
    try:
        return {"settings": run_settings(json.loads((folders[-1][1] / "meta.json").read_text())["recipe"])}
    except (IndexError, OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def resume_step(out: Path) -> int:
    """The step of the DeepSpeed state a rerun resumes from, 0 without one: the tag resume will load
    (checkpoint.state_to_resume, so that an empty or dangling `latest` is read here as it will be there, and a damaged
    state is refused before any launcher starts)."""
    tag = state_to_resume(out / "ds_state", warn=False, verify=hashes_inputs())
    return int(STEP_FOLDER.match(tag).group(1)) if tag else 0


def models(recipe: Recipe) -> tuple[str, ...]:
    """The models `align train` loads: the drafter; the verifier for labels in the step (KD losses online,
    on-policy), for the final real τ, and for a DFlash drafter.path, which reads its hidden states in every step (so
    that its layer ids are checked against that verifier before launching, and its weights are a resume's too)."""
    t = recipe.train
    labels = ("verifier.path",) if t.labels_online() or t.final_eval_prompts or reads_verifier_states(recipe) else ()
    return tuple(dict.fromkeys(drafter_reads(recipe) + labels))


def check(recipe: Recipe) -> None:
    """`align train`'s checks before any launcher starts, beyond its models': the configs (check_train), then the run
    folder's settings and the weights it started from (check_resume, check_resumed_weights: a changed recipe or
    re-saved weights are refused before launching), then the memory warning (last: after every refusal, since it
    measures; only with CUDA)."""
    check_train(recipe)
    check_resume(recipe)
    check_resumed_weights(recipe)
    if hashes_inputs() and (Path(recipe.trajectories.out) / TRAJECTORY_MANIFEST).is_file():
        verify_trajectory_files(recipe.trajectories.out)  # before launching: the ranks then read them unhashed
    if recipe.states.out is not None:  # its digests checked once per machine, before any rank reads a row
        check_states(recipe, read_trajectory_manifest(recipe.trajectories.out), verify=hashes_inputs())
    warn_train_memory(recipe, lambda r, world_size: peak_per_gpu(r, world_size).total)


def check_train(recipe: Recipe) -> None:
    """`align train`'s checks beyond its models' (only configs are read)."""
    deepspeed_config(recipe)  # a user's DeepSpeed file: read and merged now, refused before any launcher starts
    trained = TrainedDrafter.of(recipe)
    if recipe.train.lora_r and trained.loads_from_path:
        model_type = getattr(load_model_config("drafter.path", recipe.drafter), "model_type", None)
        if model_type in CANVAS_DECODER_FAMILIES:
            # peft would give the encoder and the decoder each its own adapter on the weights they share (the context
            # and the canvas would drift apart), and merging would add both adapters to those weights.
            raise RecipeError(f"train.lora_r: {recipe.drafter.path} is a {model_type} model, whose encoder and "
                              "decoder share their weights; LoRA would adapt them apart. Train it fully "
                              "(train.lora_r=0)")
    if trained.is_new_dflash:
        check_new_dflash(recipe)
    if recipe.train.data_mode == "rejections" and not reads_verifier_states(recipe):
        raise RecipeError(f"train.data_mode: rejections walks the anchors a DFlash drafter's block-parallel drafts "
                          f"visit; {recipe.drafter.path} is a {drafter_kind(recipe)} drafter (use on_policy)")
    for key, on in (("train.cache_verifier_states", recipe.train.cache_verifier_states),
                    ("states.out", recipe.states.out is not None)):
        if on and recipe.train.data_mode not in ("offline", "rejections"):
            # KD losses offline read the verifier's logits at the true prefix, which the final states give; a
            # verifier run along drafts or on new data is a new forward every step.
            raise RecipeError(f"{key}: with train.data_mode={recipe.train.data_mode}, every step runs the verifier "
                              "on new inputs, whose states nothing holds beforehand: unset it")
    if recipe.states.out is not None and not reads_verifier_states(recipe):
        raise RecipeError(f"states.out: only a DFlash drafter reads the verifier's hidden states; {recipe.drafter.path}"
                          " drafts alone: unset states.out")
    if recipe.states.out is not None and recipe.train.cache_verifier_states:
        raise RecipeError("train.cache_verifier_states: states.out holds every trajectory's states already; set it "
                          "to false")
    check_trackers("train.report_to", recipe.train.report_to, recipe.train.project)


def check_resume(recipe: Recipe) -> int:
    """The step the run in train.out resumes from (0: a new run), once the recipe is known to continue it: refused
    (RecipeError), before any model is loaded, when the run was made with other settings (run_settings, or other
    trajectories) or is already past train.max_steps."""
    out = Path(recipe.train.out)
    recorded = recorded_run(out)
    if recorded is not None:
        now = {**run_settings(recipe.to_dict()), "trajectories": trajectory_settings_hash(recipe)}
        then = {**recorded.get("settings", {}), "trajectories": recorded.get("trajectories")}
        # A key only one side has is a schema change between align versions; an unknown trajectories hash (a record
        # from before run.json, or a missing manifest, which check_data names) is not compared.
        differ = [key for key, value in now.items() if key in then and then[key] != value
                  and not (key == "trajectories" and None in (value, then[key]))]
        if differ:
            shown = "; ".join(f"{key} {then[key]!r}, now {now[key]!r}" if key != "trajectories" else
                              f"the trajectories in {recipe.trajectories.out} (another settings hash)" for key in differ)
            raise RecipeError(f"train.out: {out} holds a run made with other settings ({shown}); resume it with "
                              "the settings it was started with, or choose another train.out")
    step = resume_step(out)
    if step > recipe.train.max_steps:
        raise RecipeError(f"train.max_steps: {recipe.train.max_steps} is below step {step}, where the run in {out} "
                          f"already is; use train.max_steps >= {step}, or choose another train.out")
    return step


def weights_read(recipe: Recipe) -> dict[str, Optional[str]]:
    """The sha256 of the weights behind each model key the run reads (`models`), of a local folder or a Hub id's cached
    snapshot (None when neither is here): what run.json keeps, so that a resume notices re-saved weights behind the
    same path. Hashed once per process and state of the files (`weights_sha256_of`); only rank 0 and the check before
    launching ask."""
    return {key: weights_sha256_of(str(get_key(recipe, key))) for key in models(recipe)}


def check_resumed_weights(recipe: Recipe) -> None:
    """Refuse (RecipeError, before any launcher starts) to resume a run whose models' weights changed since it began
    (a verifier re-converted, a base drafter derived again): its checkpoints and optimizer state would continue from
    other weights without a word. Runs recorded before run.json kept weights are not compared."""
    recorded = recorded_run(Path(recipe.train.out))
    then = (recorded or {}).get("weights") or {}
    if not then or not hashes_inputs():  # once a machine, or once before launching (disk.hashes_inputs)
        return
    for key, now in weights_read(recipe).items():
        if then.get(key) and now and then[key] != now:
            raise RecipeError(f"{key}: the weights at {get_key(recipe, key)} are not the ones the run in "
                              f"{recipe.train.out} started from (sha256 {then[key][:12]}…, now {now[:12]}…); restore "
                              "them, or choose another train.out")


def finished(recipe: Recipe, step: int) -> bool:
    """Whether the run resumed at `step` has nothing left to do: every step, and the final τ when asked for."""
    t = recipe.train
    if step < t.max_steps:
        return False
    try:
        meta = json.loads((Path(t.out) / f"step_{step}" / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return t.final_eval_prompts == 0 or "final_tau" in meta


def record_run(recipe: Recipe) -> None:
    """Mark train.out as a training run and keep the settings it starts with (kept as they are on a resume)."""
    out = mark_folder(recipe.train.out, "train")
    if not (out / RUN_RECORD).is_file():
        write_text_atomic(out / RUN_RECORD, json.dumps({
            "settings": run_settings(recipe.to_dict()), "trajectories": trajectory_settings_hash(recipe),
            "weights": weights_read(recipe), "may_change_on_resume": sorted(MAY_CHANGE_ON_RESUME)}, indent=2))


def apply_activation_checkpointing(model: Any, enabled: bool) -> None:
    """train.activation_checkpointing: each layer's activations are recomputed in the backward instead of kept
    (non-reentrant, which needs no input that requires grad, so it works under LoRA's frozen embeddings)."""
    if not enabled:
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise RecipeError(f"train.activation_checkpointing: the drafter ({type(model).__name__}) does not support "
                          "gradient checkpointing; set train.activation_checkpointing=false")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def build_trainer(recipe: Recipe, data: TrainData, rank: int, world: int) -> Trainer:
    """Drafter (LoRA or full), optional online verifier, AdamW with warm-up and cosine decay, DeepSpeed engine."""
    import deepspeed

    t = recipe.train
    torch.manual_seed(t.seed)
    # Under ZeRO-3 each rank loads only its partition of the drafter (a 26B one is 52 GB whole in bf16). A LoRA
    # step_<N>/ as the drafter is merged into its base in memory, which needs the whole base: loaded whole.
    partition = t.zero_stage == 3 and world > 1 and not is_adapter_folder(recipe.drafter.path)
    model, spec, tokenizer, mask_token = build_drafter(recipe, deepspeed_config(recipe) if partition else None)
    if mask_token is not None and rank == 0:
        print(f"align train: the drafter marks masked positions with {mask_token}")
    model.train()
    apply_activation_checkpointing(model, t.activation_checkpointing)
    if t.lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=t.lora_r, lora_alpha=t.lora_alpha, target_modules="all-linear"))
    else:
        model.requires_grad_(True)
    # A DFlash drafter reads the verifier's hidden states in every step: from states.out, where they were computed
    # beforehand, with only the verifier's embeddings and head (which the drafter shares) on this rank.
    reads_verifier = drafter_for(model, spec).verifier_states is not None
    precomputed = reads_verifier and recipe.states.out is not None
    verifier = (load_verifier_ends(recipe.verifier) if precomputed else
                load_verifier(recipe.verifier) if data.online or reads_verifier else None)
    trained = TrainedDrafter.of(recipe)
    if trained.draft_vocab_size:
        # Before the engine copies the weights into its optimiser state; a resumed run's saved maps and head replace
        # these (the same, as the data and the ranking are).
        rows = data.rows.select(data.train_rows)
        keep = most_frequent_tokens(rows["completion_ids"], rows["prompt_ids"], trained.draft_vocab_size,
                                    model.config.vocab_size)
        set_draft_vocab(model, verifier.get_output_embeddings().weight, keep)
    # A torch AdamW rather than a DeepSpeed-config optimizer: no fused-Adam JIT build, and the same on CPU and GPU.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=t.lr,
                                  weight_decay=t.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, t.warmup_steps)) * (
        0.5 * (1 + math.cos(math.pi * min(1.0, s / t.max_steps)))))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule,
                                           config=deepspeed_config(recipe))
    # What ZeRO's optimizer does with it (its own flags, not the config's), said once: a user's offload is visible.
    offloaded = [what for what, flag in (("optimizer state", "offload_optimizer"), ("parameters", "offload_param"))
                 if getattr(engine.optimizer, flag, False)]
    if offloaded and rank == 0:
        print(f"align train: ZeRO-{t.zero_stage} offloads its {' and '.join(offloaded)} to the CPU", flush=True)
    if trained.loads_from_path and is_partitioned(model) and recipe.drafter.trust_remote_code:
        # load_drafter's check, now that the engine's hooks gather the weights; the mark goes on the drafter itself
        # (a peft wrapper passes reads of it through), as load_drafter puts it.
        check_masks_are_read(model.get_base_model() if t.lora_r else model, spec)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    states = (open_states_store(recipe, model, verifier) if precomputed else
              open_states_cache(recipe, data, model, verifier if reads_verifier else None, rank, world)
              if t.cache_verifier_states else None)
    return Trainer(engine, schedule, spec, tokenizer, verifier, WINDOW_BUILDERS[spec.attention], pad_id, rank, world,
                   engine.device, mask_token, states)


def states_width(recipe: Recipe, model: Any) -> int:
    """Values a token of the states a step reads: the drafter's layers', and the final ones where a KD loss reads the
    verifier's logits."""
    with_last = recipe.train.reads_verifier_distributions()
    return (len(model.config.aux_hidden_state_layer_ids) + with_last) * model.config.target_hidden_size


def open_states_store(recipe: Recipe, model: Any, verifier: torch.nn.Module) -> StatesStore:
    """states.out mapped on this rank (its manifest and digests were checked before launching)."""
    folder = Path(recipe.states.out)
    return StatesStore(folder, read_states_manifest(folder), states_width(recipe, model), verifier.dtype)


def open_states_cache(recipe: Recipe, data: TrainData, model: Any, verifier: Optional[torch.nn.Module], rank: int,
                      world: int) -> StatesCache:
    """train.cache_verifier_states: the cache files made by rank 0 under train.out, mapped by every rank. verifier:
    the one the drafter reads (None: it reads none)."""
    key = "train.cache_verifier_states"
    if verifier is None:
        raise RecipeError(f"{key}: keeps the verifier states a DFlash drafter reads; {type(model).__name__} reads "
                          "none: set it to false")
    if spans_machines(world):
        raise RecipeError(f"{key}: the ranks share the cache through one machine's files, and these {world} ranks "
                          "span several machines: set it to false")
    cap = recipe.train.max_sequence_length or math.inf  # the builders cut each row there: so are its states
    lengths = [min(len(p) + len(c), cap) for p, c in zip(data.rows["prompt_ids"], data.rows["completion_ids"])]
    # KD losses' verifier logits come from its final states, kept beside the ones the drafter reads.
    cache = StatesCache(Path(recipe.train.out), lengths, states_width(recipe, model), verifier.dtype)
    if rank == 0:
        cache.create()
    if world > 1:
        dist.barrier()  # the files exist before any rank maps them
    return cache.open()


def resume(trainer: Trainer, out: Path) -> int:
    """Load the last complete DeepSpeed state under out/ds_state (0 without one), and drop metrics of later steps,
    which the resumed run will log again. A damaged state or metrics file is refused naming the file (RecipeError)."""
    state_dir = out / "ds_state"
    tag = state_on_every_rank(state_dir, trainer)
    start = 0
    if tag is not None:
        try:
            loaded, client = trainer.engine.load_checkpoint(str(state_dir), tag=tag,
                                                            load_module_strict=not is_lora(trainer.engine.module))
        except Exception as e:  # torch's zip reader, DeepSpeed's asserts: neither names the file
            raise RecipeError(f"train.out: {state_dir / tag} cannot be loaded ({first_line(e)}); if its files are "
                              f"damaged, write an earlier complete tag into {state_dir / 'latest'} to resume from "
                              "there (nothing is deleted)") from None
        if loaded is None or not client or "step" not in client:
            raise RecipeError(f"train.out: {state_dir / tag} holds no loadable DeepSpeed state (files missing); write "
                              f"an earlier complete tag into {state_dir / 'latest'} to resume from there")
        start = client["step"]
        follow_schedule(trainer.schedule, start)
    metrics = out / "metrics.jsonl"
    if trainer.rank == 0 and metrics.is_file():  # read tolerantly: a cut last line is dropped (and said)
        kept = [r for r in read_log(metrics, "align train") if r.get("step", 0) <= start and "final_tau" not in r]
        write_text_atomic(metrics, "".join(json.dumps(r) + "\n" for r in kept))
    if trainer.rank == 0 and start:
        print(f"align train: resuming from step {start}")
    return start


def follow_schedule(schedule: Any, step: int) -> None:
    """Set the optimizer's rate to what this run's schedule gives at `step`. The loaded scheduler state keeps the rate
    the saved run had last computed: after a resume with a raised train.max_steps, the first step would run at the
    old schedule's end (0.0 for a finished cosine) and only the next at the new one."""
    rates = [base * rate(step) for base, rate in zip(schedule.base_lrs, schedule.lr_lambdas)]
    for group, lr in zip(schedule.optimizer.param_groups, rates):
        group["lr"] = lr
    schedule.last_epoch, schedule._last_lr = step, rates


def check_launch(recipe: Recipe, world: int) -> None:
    """What `align train` checks before it launches `world` ranks (cli): that the state it resumes was saved by as many."""
    step = resume_step(Path(recipe.train.out))
    if not finished(recipe, step):
        check_resume_world(recipe, step, world)


def check_resume_world(recipe: Recipe, step: int, world: int) -> None:
    """Refuse (RecipeError, before any model loads) to resume a ZeRO state on another number of ranks than saved it:
    ZeRO splits the optimizer state into a shard per rank, and DeepSpeed reloads the shards on as many ranks only
    (it fails an assertion otherwise). The state is whole and valid, and the refusal says so."""
    state = Path(recipe.train.out) / "ds_state" / f"step_{step}"
    saved = len(list(state.glob("*zero_pp_rank_*_optim_states.pt"))) if step else 0
    if saved and saved != world:
        raise RecipeError(f"train.out: the run in {recipe.train.out} saved step {step} on {saved} ranks (ZeRO-"
                          f"{recipe.train.zero_stage} keeps an optimizer shard per rank), and this launch has {world}; "
                          f"that state is complete: resume on {saved} ranks (--num_gpus {saved} on one node), or "
                          f"train on from its weights as a new run (drafter.path={recipe.train.out}/step_{step}, "
                          "another train.out; the optimizer starts afresh)")


def state_on_every_rank(state_dir: Path, trainer: Trainer) -> Optional[str]:
    """The tag to resume (checkpoint.state_to_resume), decided on rank 0 and told to every rank, so that all load the
    same state or all refuse with the same reason."""
    decision: list[Any] = [None]
    if trainer.rank == 0:
        try:
            # Hashed already, in this process's check or the launcher's (hashes_inputs): not read again here.
            decision = [("tag", state_to_resume(state_dir, verify=hashes_inputs()))]
        except RecipeError as e:
            decision = [("error", str(e))]
    if trainer.world > 1:
        dist.broadcast_object_list(decision, src=0)
    kind, value = decision[0]
    if kind == "error":
        raise RecipeError(value)
    return value


# --------------------------------------------------------------------------------------------------------------------
# the step
# --------------------------------------------------------------------------------------------------------------------
def agreed_forwards(trainer: Trainer, batch: WindowBatch, recipe: Recipe) -> int:
    """How many drafter forwards every rank makes for its micro-batch: under ZeRO-3 each forward (and backward)
    gathers parameters from every rank, so all make the most any rank's batch needs (`window_forwards`; a canvas
    decoder's grows with its rows' windows), the others padding forwards. 0 (no padding) outside ZeRO-3."""
    if recipe.train.zero_stage != 3 or trainer.world == 1:
        return 0
    count = torch.tensor([window_forwards(trainer.engine.module, trainer.spec, batch)], device=trainer.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def rejections_of(trainer: Trainer, batch: WindowBatch, rows: list[dict], recipe: Recipe, position: int
                  ) -> WindowBatch:
    """train.data_mode=rejections: `batch`'s rows' windows at the anchors greedy decoding visits where verification
    rejected the draft (align/onpolicy.py). The verifier runs once for the rows (or its states come from the cache),
    for the drafter's no-grad pass over every anchor and the trained pass over the rejected ones."""
    if batch.verifier_states is None:
        batch.verifier_states = verifier_states(trainer.verifier, batch.clean_ids,
                                                trainer.engine.module.config.aux_hidden_state_layer_ids,
                                                with_last=recipe.train.reads_verifier_distributions())
    t = recipe.train
    return rejection_batch(trainer.engine.module, trainer.spec, trainer.verifier, batch, rows, t.gamma,
                           t.windows_per_sequence, trainer.pad_id, np.random.default_rng([t.seed, position, 1]))


def compute_losses(trainer: Trainer, batch: WindowBatch, rows: list[dict], recipe: Recipe, num_windows: int,
                   num_tokens: int) -> dict[str, torch.Tensor]:
    """Each weighted loss of the recipe on one micro-batch, normalised by the whole step's window/token counts."""
    targets, mask = batch.targets.flatten(0, 1), batch.target_mask.flatten(0, 1)
    # A DFlash drafter's verifier forward also gives KD losses their distributions (exact, not the stored top-k).
    draft_logits, verifier_logits = drafter_for(trainer.engine.module, trainer.spec).window_logits(
        batch, trainer.verifier, forwards=agreed_forwards(trainer, batch, recipe))
    draft_logits = draft_logits.float().flatten(0, 1)  # (B·W, γ, V), V the drafter's vocabulary
    if verifier_logits is not None:
        verifier_logits = verifier_logits.float().flatten(0, 1)
    # A pruned DFlash drafter's logits are over its draft vocabulary: targets become draft ids, a distribution its
    # columns (renormalised over them by the losses' softmax, as speculators trains), and ids it cannot draft end
    # the window's streak.
    vocab = DraftVocab.of(trainer.engine.module)
    if recipe.train.data_mode == "on_policy":
        # The drafter's own argmax drafts, labelled by the verifier along them: targets are the verifier's greedy
        # tokens there (what greedy verification would accept), distributions its distributions there.
        with torch.no_grad():
            drafts = draft_logits.argmax(-1).view(batch.targets.shape)
            drafts = drafts if vocab is None else vocab.target_ids[drafts]
            verifier_logits = verifier_path_logits(trainer.verifier, batch, drafts, trainer.pad_id)
            verifier_logits = verifier_logits.float().flatten(0, 1)
        targets = verifier_logits.argmax(-1)
        if vocab is not None:
            verifier_logits = vocab.columns(verifier_logits)
    if vocab is not None:
        targets, mask = vocab.training_targets(targets, mask)
    parts = {}
    for name, weight in recipe.train.losses.items():
        fn = WINDOW_LOSSES[name][0]
        count = normalisation(name, num_windows, num_tokens)
        if not needs_verifier_distributions(name):
            parts[name] = weight * fn(draft_logits, targets, mask, **count)
            continue
        if verifier_logits is None:
            with torch.no_grad():
                verifier_logits = (verifier_window_logits(trainer.verifier, batch) if trainer.verifier is not None
                                   else topk_window_logits(rows, batch, draft_logits.shape[-1]))
                verifier_logits = verifier_logits.float().flatten(0, 1)
        parts[name] = weight * fn(draft_logits, verifier_logits, mask, **count)
    return parts


def weights_finite(engine: Any, world: int) -> bool:
    """Every trainable weight finite, on every rank. Under ZeRO-3 a rank holds a partition (`ds_tensor`) of each
    parameter, and the partitions together are the whole. One host sync a step: a `bool()` per parameter would wait
    for the device once per parameter (hundreds a step on a GPU)."""
    tensors = [getattr(p, "ds_tensor", p) for p in engine.module.parameters() if p.requires_grad]
    finite = torch.stack([torch.isfinite(t).all() for t in tensors]).all() if tensors else torch.tensor(True)
    return all_ranks(finite, world, engine.device)


def train_step(trainer: Trainer, built: StepBatches, recipe: Recipe, step: int, t0: float
               ) -> Optional[dict[str, Any]]:
    """One optimiser step (with accumulation) on its batches (align/batches.py); its metrics, or None when a loss or
    the updated weights are not finite (the update is then not to be kept). t0: when the step asked for its batches."""
    t, world = recipe.train, trainer.world
    lr = trainer.schedule.get_last_lr()[0]  # the rate this step's update uses; engine.step() moves the schedule on
    positions, micro_rows = built.positions, built.rows
    batches = [b.to(trainer.device, non_blocking=True) for b in built.batches]  # host to device: safe unwaited
    for ids, batch in zip(built.row_ids, batches):
        attach_states(trainer, recipe, ids, batch)
    if t.data_mode == "rejections":
        batches = [rejections_of(trainer, batch, rows, recipe, p)
                   for batch, rows, p in zip(batches, micro_rows, positions)]
    # Normalise by the whole step's counts over every rank, so accumulation and data parallelism change nothing.
    counts = torch.tensor([sum(b.num_windows for b in batches), sum(int(b.target_mask.sum()) for b in batches)],
                          dtype=torch.float64, device=trainer.device)
    if world > 1:
        dist.all_reduce(counts)
    scale = t.gradient_accumulation_steps * world  # DeepSpeed divides by both; undo it for an exact sum
    totals: dict[str, float] = {}
    for rows, batch in zip(micro_rows, batches):
        # max(1, ·): a step may draw no window at all (train.max_sequence_length filled by its prompts); its losses
        # are then 0 rather than 0 / 0
        parts = compute_losses(trainer, batch, rows, recipe, max(1, int(counts[0])), max(1, int(counts[1])))
        loss = sum(parts.values())
        if not all_ranks(bool(torch.isfinite(loss)), world, trainer.device):
            return None
        trainer.engine.backward(loss * scale)
        trainer.engine.step()
        for name, value in parts.items():
            totals[name] = totals.get(name, 0.0) + value.item()
    if not weights_finite(trainer.engine, world):
        return None
    summed = torch.tensor(list(totals.values()), dtype=torch.float64, device=trainer.device)
    if world > 1:
        dist.all_reduce(summed)
    return {"step": step + 1, "loss": float(summed.sum()), **dict(zip(totals, summed.tolist())),
            "lr": lr, "windows": int(counts[0]),
            "tokens_per_s_per_rank": float(sum(b.target_mask.sum() for b in batches)) / (time.perf_counter() - t0)}


def attach_states(trainer: Trainer, recipe: Recipe, rows: list[int], batch: WindowBatch) -> None:
    """The verifier states of a batch of dataset `rows`, read where stored (states.out, or the run's cache where a
    step computed them already; the final states too where a KD loss reads the verifier's logits). Without either,
    the drafter's forward runs the verifier itself."""
    if trainer.states is None or batch.verifier_states is not None:  # none, or read with the batch (states.out)
        return
    layer_ids = trainer.engine.module.config.aux_hidden_state_layer_ids
    with_last = recipe.train.reads_verifier_distributions()
    batch.verifier_states = batch_states(
        trainer.states, rows, batch.clean_ids,
        lambda clean: verifier_states(trainer.verifier, clean, layer_ids, with_last=with_last))


def held_out_sample(held_out: list[int], max_rows: Optional[int], seed: int) -> list[int]:
    """At most `max_rows` of the held-out rows (all when None): a seeded sample, the same at every eval and in any
    process layout, so that the metric compares like with like across a run and costs a bounded time."""
    if max_rows is None or len(held_out) <= max_rows:
        return held_out
    chosen = np.random.default_rng([seed, len(held_out)]).choice(len(held_out), size=max_rows, replace=False)
    return [held_out[i] for i in sorted(chosen)]


def window_streaks(logits: torch.Tensor, targets: torch.Tensor, target_mask: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, W, γ, V) in any float dtype, targets (B, W, γ), target_mask (B, W, γ) bool -> (B, W) expected
    streak Σ_j Π_{i≤j} q(x_i) and (B, W) greedy streak (argmax hits before the first miss), both fp32.

    log q(x) is computed in chunks of positions (losses.rowwise): over a 150k–262k vocabulary an fp32 log_softmax of
    every window position at once would be the largest tensor of the metric. The argmax reads the logits as they are
    (widening to fp32 is exact, so it picks the same token)."""
    log_q = rowwise(_row_target_log_prob, logits, targets).masked_fill(~target_mask, float("-inf"))
    hits = (logits.argmax(-1) == targets) & target_mask
    return torch.exp(torch.cumsum(log_q, -1)).sum(-1), hits.int().cumprod(-1).sum(-1).float()


@torch.no_grad()
def held_out_streak(trainer: Trainer, data: TrainData, recipe: Recipe) -> dict[str, float]:
    """Simulated accepted length on held-out trajectories: the expected streak Σ_j Π_{i≤j} q(x_i), and the greedy
    streak (draft tokens matching x before the first miss), per window, averaged over every rank's share."""
    t = recipe.train
    totals = torch.zeros(3, dtype=torch.float64, device=trainer.device)
    mine, weights = rank_share(held_out_sample(data.held_out, t.held_out_max_rows, t.seed), trainer.rank,
                               trainer.world)
    for start in range(0, len(mine), t.micro_batch_size):
        ids = mine[start : start + t.micro_batch_size]
        rows = [data.rows[i] for i in ids]
        batch = trainer.build(rows, trainer.spec, t.gamma, t.windows_per_sequence, trainer.pad_id,
                              np.random.default_rng([t.seed, start]), max_len=t.max_sequence_length).to(trainer.device)
        attach_states(trainer, recipe, ids, batch)
        # In the drafter's own dtype: window_streaks reads it in fp32 chunk by chunk, never as one fp32 copy.
        logits = window_logits(trainer.engine.module, trainer.spec, batch, trainer.verifier,
                               forwards=agreed_forwards(trainer, batch, recipe))
        expected, greedy = window_streaks(logits, batch.targets, batch.target_mask)
        # Per trajectory; a bidirectional batch has a row per window, each naming its trajectory in source_rows.
        weight = torch.tensor(weights[start : start + t.micro_batch_size], dtype=torch.float64,
                              device=trainer.device)[batch.source_rows][:, None]
        valid = batch.target_mask[..., 0] * weight  # (B, W): padding rows count 0
        totals += torch.stack([(expected * valid).sum(), (greedy * valid).sum(), valid.sum()])
    if trainer.world > 1:
        dist.all_reduce(totals)
    return {"expected_streak": totals[0].item() / max(totals[2].item(), 1),
            "greedy_streak": totals[1].item() / max(totals[2].item(), 1)}


# --------------------------------------------------------------------------------------------------------------------
# saving and the final check
# --------------------------------------------------------------------------------------------------------------------
def final_tau(recipe: Recipe, checkpoint: Path, data: TrainData, count: int,
              verifier: Optional[torch.nn.Module] = None) -> dict[str, float]:
    """τ of SpecDiff greedy decoding (γ = train.gamma, 64 new tokens) with the saved checkpoint on held-out prompts.
    verifier: the one the steps ran, lent; else it is loaded."""
    verifier = verifier if verifier is not None else load_verifier(recipe.verifier)
    section = recipe.drafter.model_copy(update={"path": str(checkpoint)})
    drafter, spec = load_drafter(section, load_tokenizer(str(checkpoint), section.trust_remote_code))
    prompts, seen = [], set()
    for i in data.held_out:
        if data.rows[i]["prompt_index"] not in seen and len(prompts) < count:
            seen.add(data.rows[i]["prompt_index"])
            prompts.append(torch.tensor([data.rows[i]["prompt_ids"]], device=verifier.device))
    counts = []
    for ids in prompts:
        counts += specdiff_generate(verifier, drafter, spec, ids, recipe.train.gamma, 64)[1].accept_counts
    return {"final_tau": sum(n + 1 for n in counts) / max(len(counts), 1), "final_tau_prompts": len(prompts)}


def record_final_tau(recipe: Recipe, out: Path, data: TrainData, verifier: Optional[torch.nn.Module]
                     ) -> dict[str, float]:
    step = recipe.train.max_steps
    record = final_tau(recipe, out / f"step_{step}", data, recipe.train.final_eval_prompts, verifier)
    append_log(out / "metrics.jsonl", {"step": step, **record})
    meta_path = out / f"step_{step}" / "meta.json"
    write_text_atomic(meta_path, json.dumps({**json.loads(meta_path.read_text()), **record}, indent=2))
    record_checksums(meta_path.parent, ["meta.json"])
    print(f"align train: real τ on {record['final_tau_prompts']} held-out prompts: {record['final_tau']:.3f}")
    return record


# --------------------------------------------------------------------------------------------------------------------
# the stage
# --------------------------------------------------------------------------------------------------------------------
def main(recipe: Recipe, command: str) -> int:
    t, out = recipe.train, Path(recipe.train.out)
    data = check_data(recipe)
    # Every rank reads the same files, so all take the same branch here, before any collective.
    start = check_resume(recipe)
    if finished(recipe, start):
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"align train: {out} is complete ({start} of {t.max_steps} steps); nothing to do (a higher "
                  "train.max_steps trains it further)")
        return 0
    check_resume_world(recipe, start, int(os.environ.get("WORLD_SIZE", 1)))  # the ranks this process is one of
    if int(os.environ.get("RANK", 0)) == 0:
        record_run(recipe)
    timeout = collective_timeout(recipe)
    rank, world = init_distributed(timeout)
    check_shared_folder(out, "train.out", rank, world)  # before any model is loaded
    watched = watch_peers(rank, world, t.peer_silence_s)
    if rank == 0 and world > 1:
        print(f"align train: a rank waits up to {timeout.total_seconds() / 60:.0f} min for the others in a collective "
              "(rank 0 writes each checkpoint meanwhile; DEEPSPEED_TIMEOUT=<minutes> sets it)")
    trainer = build_trainer(recipe, data, rank, world)
    start = resume(trainer, out)
    # The experiment trackers (train.report_to) live on rank 0, which holds every metric after the step's reductions.
    trackers = open_trackers(t.report_to, out, t.project, t.run_name, recipe.to_dict(), start) if rank == 0 else None
    meta = {"recipe": recipe.to_dict(), "drafter_base": TrainedDrafter.of(recipe).base, "verifier": recipe.verifier.path,
            "drafter_spec": trainer.spec.to_dict(), "world_size": world, "threads_per_rank": torch.get_num_threads(),
            "command": command, **({"mask_token": trainer.mask_token} if trainer.mask_token else {})}
    status = 0
    on_gpu = trainer.device.type == "cuda"
    store = trainer.states if isinstance(trainer.states, StatesStore) else None
    stream = batch_stream(partial(step_batches, data, recipe, trainer.build, trainer.spec, trainer.pad_id, rank, world,
                                  store), start, t.max_steps,
                          t.batch_workers if t.batch_workers is not None else int(on_gpu), pin=on_gpu)
    # A `with`: a failure mid-run (a full disk) closes the bar first, so the one line that says it starts a line.
    with tqdm(total=t.max_steps, initial=start, desc="align", unit="step", disable=rank != 0,
              dynamic_ncols=True) as bar:
        for step in range(start, t.max_steps):
            t0 = time.perf_counter()  # before next(): a batch the loop builds counts in the step's time, as before
            record = train_step(trainer, next(stream), recipe, step, t0)
            if record is None:
                last = step_folders(out)
                if rank == 0:
                    bar.write(f"align train: step {step + 1} gave a non-finite loss or non-finite weights (learning "
                              f"rate {t.lr:g} too high?); stopping with the last good checkpoint intact: "
                              f"{last[-1][1] if last else 'none saved'}", file=sys.stderr)
                status = EXIT_NOT_FINITE
                break
            if (step + 1) % t.eval_every == 0 or step + 1 == t.max_steps:
                trainer.engine.eval()
                record.update(held_out_streak(trainer, data, recipe))
                trainer.engine.train()
            if rank == 0:
                append_log(out / "metrics.jsonl", record)
                trackers.log({k: v for k, v in record.items() if k != "step"}, step + 1)
                bar.update()
                bar.set_postfix(loss=f"{record['loss']:.4f}")
            if (step + 1) % t.save_every == 0 or step + 1 == t.max_steps:
                save_checkpoint(trainer, recipe, out, step + 1, {**meta, "metrics": record})
    # Real τ with the runtime (training accuracy alone misleads), from the final merged checkpoint, once the engine
    # (the drafter, its optimiser state, ZeRO's buffers) is gone: rank 0 would hold them beside the merged drafter.
    # The verifier the steps ran whole is lent to it (states.out runs hold only its ends), not loaded a second time.
    states, verifier = trainer.states, trainer.verifier if recipe.states.out is None else None
    trainer.engine.destroy()
    del trainer, stream  # the stream's workers too
    gc.collect()
    if rank == 0 and status == 0 and t.final_eval_prompts:
        trackers.log(record_final_tau(recipe, out, data, verifier), t.max_steps)
    if trackers is not None:
        trackers.close()
    dist.barrier()
    watched.set()  # every rank is done: each leaves at its own pace now
    if states is not None and rank == 0:
        states.remove()  # every rank is past its last step (the barrier)
    dist.destroy_process_group()
    return status
