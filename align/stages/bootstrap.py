"""`align bootstrap`: build the tiny embedded family (DESIGN §4) from the Python standard library's source.

Parts, each written atomically to `<bootstrap.out>/<part>/` with a manifest.json, and kept when the manifest already
matches the recipe (so a re-run resumes at the first missing part):

  tokenizer     byte-level BPE with end-of-text, pad and mask tokens
  verifier      Llama-style causal LM, next-token objective
  drafter-base  block-causal masked-diffusion LM (MDLM objective), the diffusion drafter before alignment
  ar-drafter    causal LM of the drafter's size, the baseline drafter

Pretraining runs against a wall-clock budget and saves a resumable state every few minutes, so a killed run loses
at most that much work (align/pretraining.py's loop and MDLM step, which `align derive` shares).
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from align import __version__
from align.checkpoint import save_merged
from align.config import Recipe, RecipeError
from align.config_inputs import PretrainSection
from align.corpus import SPLITS, build_data, prompt_sets, read_corpus, read_manifest
from align.disk import atomic_folder, mark_folder
from align.drafters.spec import DrafterSpec
from align.pretraining import (Schedule, leading_windows, mdlm_step, mean_loss, next_token_step, random_windows,
                               train_loop, use_bf16)

EOT, PAD, MASK = "<|endoftext|>", "<|pad|>", "<|mask|>"
PARTS: tuple[str, ...] = ("tokenizer", "verifier", "drafter-base", "ar-drafter")


# --------------------------------------------------------------------------------------------------------------------
# small utilities
# --------------------------------------------------------------------------------------------------------------------
def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------------------------
# data: corpus, prompt sets, token streams
# --------------------------------------------------------------------------------------------------------------------
def token_stream(tokenizer: Any, rows: list[dict[str, str]]) -> np.ndarray:
    """All files of a split as one int32 stream, each file followed by end-of-text."""
    ids = tokenizer([r["text"] for r in rows], add_special_tokens=False)["input_ids"]
    eot = tokenizer.eos_token_id
    return np.fromiter((t for doc in ids for t in (*doc, eot)), dtype=np.int32)


# --------------------------------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    # Byte-level: any text round-trips, indentation included, with no unknown token.
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT, PAD, MASK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOT, pad_token=PAD, mask_token=MASK)
    tokenizer.save_pretrained(out)


# --------------------------------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------------------------------
def build_model(cfg: PretrainSection, tokenizer: Any, drafter_spec: DrafterSpec | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config}[cfg.arch]
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        # Tied embeddings halve the size of these vocabulary-heavy small models.
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if drafter_spec is not None:
        config.drafter_spec = drafter_spec.to_dict()
    return AutoModelForCausalLM.from_config(config)


def ar_step(model: torch.nn.Module, window: torch.Tensor, cfg: PretrainSection, gen: torch.Generator,
            step: int = 0) -> torch.Tensor:
    """Next-token loss on a (B, L+1) window (the step signature `pretrain` calls)."""
    return next_token_step(model, window)


def schedule_of(cfg: PretrainSection) -> Schedule:
    """A part's pretraining schedule: against its wall-clock budget."""
    return Schedule(cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio, cfg.weight_decay, cfg.save_every_minutes,
                    budget_minutes=cfg.budget_minutes)


def validation_loss(model: torch.nn.Module, step_fn: Callable, stream: np.ndarray, cfg: PretrainSection,
                    bf16: bool) -> float:
    """Mean loss (nats/token) over the first `eval_tokens` tokens of the validation stream, fixed masking seed."""
    windows = leading_windows(stream, cfg.seq_len, cfg.eval_tokens, cfg.batch_size)
    return mean_loss(model, lambda m, w, g, step: step_fn(m, w, cfg, g, step), windows, bf16)


def pretrain(
    part: str, cfg: PretrainSection, model: torch.nn.Module, streams: dict[str, np.ndarray], step_fn: Callable,
    work: Path, config_hash: str, seed: int, bf16: bool,
) -> dict[str, Any]:
    """Train `model` until the wall-clock budget is spent, resuming from `work/state.pt` if a killed run left one
    (align/pretraining.py's loop, which align derive shares)."""
    stats = train_loop(part, model, lambda m, w, g, step: step_fn(m, w, cfg, g, step),
                       lambda rng: random_windows(streams["train"], cfg.batch_size, cfg.seq_len, rng),
                       schedule_of(cfg), work, config_hash, seed, bf16)
    val = validation_loss(model, step_fn, streams["validation"], cfg, bf16)
    print(f"[{part}] {stats['steps']} steps, {stats['tokens_seen']:,} tokens, train loss {stats['train_loss']:.3f}, "
          f"validation {val:.3f} nats/token")
    return {**stats, "validation_loss": val}


@torch.no_grad()
def greedy_samples(model: torch.nn.Module, tokenizer: Any, prompts: list[dict[str, str]], n: int = 3,
                   new_tokens: int = 48) -> list[dict[str, str]]:
    """Greedy completions of the first `n` test prompts, kept in the verifier's manifest for a human to read."""
    model.eval()
    samples = []
    for task in prompts[:n]:
        ids = tokenizer(task["prompt"], return_tensors="pt").input_ids
        # A mask of ones: without it generate() hides every prompt token equal to the pad id.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        samples.append({"task_id": task["task_id"], "prompt": task["prompt"],
                        "completion": tokenizer.decode(out[0, ids.shape[1]:])})
    return samples


# --------------------------------------------------------------------------------------------------------------------
# the stage
# --------------------------------------------------------------------------------------------------------------------
def main(recipe: Recipe, command: str) -> None:
    """`command` is the command line that ran this stage, recorded in every manifest."""
    cfg = recipe.bootstrap
    out, data_dir = Path(cfg.out), Path(recipe.data.dir)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    bf16 = use_bf16(cfg.precision)
    print(f"bootstrap: corpus -> {data_dir}, models -> {out}, precision {'bf16' if bf16 else 'fp32'}")
    # Every check first: a refused bootstrap must leave data.dir and bootstrap.out as they were.
    corpus = read_corpus(cfg.corpus_fraction)
    empty = [s for s in SPLITS if not corpus[s]]
    if empty:
        raise RecipeError(f"bootstrap.corpus_fraction: {cfg.corpus_fraction} leaves no {'/'.join(empty)} files; raise it")
    tok_dir = out / "tokenizer"
    if "tokenizer" not in cfg.parts and not (tok_dir / "tokenizer_config.json").is_file():
        raise RecipeError(f"bootstrap.parts: there is no tokenizer at {tok_dir} to build the other parts with; include "
                          "'tokenizer'")
    digest = build_data(data_dir, corpus, cfg.corpus_fraction)
    mark_folder(out, "bootstrap")
    common = {"corpus_hash": digest, "vocab_size": cfg.vocab_size, "seed": cfg.seed,
              "corpus_fraction": cfg.corpus_fraction, "align": __version__}
    provenance = {"command": command, "corpus_hash": digest, "python": platform.python_version(),
                  "torch": torch.__version__, "precision": "bf16" if bf16 else "fp32", "recipe": recipe.name}

    from transformers import AutoTokenizer

    tok_hash = _hash({"part": "tokenizer", **common})
    if "tokenizer" in cfg.parts and (cfg.force or (read_manifest(tok_dir) or {}).get("config_hash") != tok_hash):
        t0 = time.time()
        with atomic_folder(tok_dir, "bootstrap") as tmp:
            train_tokenizer([r["text"] for r in corpus["train"]], cfg.vocab_size, tmp)
            (tmp / "manifest.json").write_text(json.dumps(
                {"part": "tokenizer", "config_hash": tok_hash, "vocab_size": cfg.vocab_size,
                 "special_tokens": {"eos": EOT, "pad": PAD, "mask": MASK}, "wall_time_s": round(time.time() - t0, 1),
                 **provenance}, indent=2))
        print(f"[tokenizer] {cfg.vocab_size} tokens -> {tok_dir}")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    tok_manifest = read_manifest(tok_dir) or {}

    streams: dict[str, np.ndarray] | None = None
    test_prompts = prompt_sets({"train": [], "test": corpus["test"]})["test"]
    model_parts = {
        "verifier": (cfg.verifier, None),
        "drafter-base": (cfg.drafter, DrafterSpec(tokenizer.mask_token_id, 0, "block_causal")),
        "ar-drafter": (cfg.ar_drafter, None),
    }
    for part in (p for p in PARTS[1:] if p in cfg.parts):
        pcfg, spec = model_parts[part]
        config_hash = _hash({"part": part, "model": pcfg.model_dump(mode="json"), "tokenizer": tok_manifest.get("config_hash"), **common})
        final = out / part
        if not cfg.force and (read_manifest(final) or {}).get("config_hash") == config_hash:
            print(f"[{part}] up to date ({final}/manifest.json matches the recipe); bootstrap.force=true rebuilds it")
            continue
        if streams is None:
            streams = {s: token_stream(tokenizer, corpus[s]) for s in ("train", "validation")}
            print(f"tokens: train {len(streams['train']):,}, validation {len(streams['validation']):,}")
        torch.manual_seed(cfg.seed)
        model = build_model(pcfg, tokenizer, spec)
        if pcfg.objective == "mdlm":
            mask_id = tokenizer.mask_token_id
            sizes = pcfg.block_sizes
            step_fn = lambda m, w, c, g, step: mdlm_step(m, w, g, mask_id, sizes[step % len(sizes)])  # noqa: E731
        else:
            step_fn = ar_step
        n_params = sum(p.numel() for p in model.parameters())
        print(f"[{part}] {pcfg.arch}, {n_params / 1e6:.1f}M parameters, {pcfg.objective} objective, "
              f"{pcfg.budget_minutes} min budget")
        stats = pretrain(part, pcfg, model, streams, step_fn, out / ".work" / part, config_hash, cfg.seed, bf16)
        manifest = {"part": part, "config_hash": config_hash, "parameters": n_params, **stats,
                    "validation_loss_kind": "MDLM bound (nats/token)" if pcfg.objective == "mdlm" else "next-token cross-entropy (nats/token)",
                    "architecture": pcfg.model_dump(mode="json"), **provenance}
        if spec is not None:
            manifest["drafter_spec"] = spec.to_dict()
        if part == "verifier":
            manifest["samples"] = greedy_samples(model, tokenizer, test_prompts)
        # Weights ship in bf16 (half the size); the runtime upcasts on CPU.
        save_merged(model.to(torch.bfloat16), tokenizer, final, {"manifest.json": json.dumps(manifest, indent=2)},
                    kind="bootstrap")
        shutil.rmtree(out / ".work" / part, ignore_errors=True)
        print(f"[{part}] -> {final}")
