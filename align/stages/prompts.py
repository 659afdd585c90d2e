"""`align prompts`: training prompts the verifier writes itself (Magpie: Xu et al. 2024, arXiv 2406.08464).

The verifier's chat template is rendered up to where a user's message begins (with its default system prompt, exactly
as every stage renders a user-only prompt, or after a system message of prompts.system_prompts, which steers what the
users ask); the verifier samples the message (transformers' generate, or vLLM with prompts.backend vllm), which ends
at its end-of-turn token;
the samples are filtered (cut short, special tokens, too short, not ASCII, sampling loops, duplicates and
near-duplicates). What comes out is a JSONL of `messages` (one user turn each) that `align trajectories` reads with
`data.train_prompts=<out>/prompts.jsonl data.prompt_column=messages`.

Why Magpie, for training a drafter:
- in distribution: a drafter learns to draft the verifier's answers to the requests it will serve, and the requests
  an instruct model pictures a user making are the ones its instruction tuning made typical;
- licence-clean: the prompts are the verifier's own outputs (under its licence, Apache-2.0 for SmolLM2), not a
  dataset with terms of its own;
- no benchmark can leak in: no dataset is read at all, so no GSM8K, HumanEval or Spec-Bench item (what align eval
  measures on) is ever a training prompt. The manifest says so.

Resumable: samples are drawn in chunks of prompts.batch_size, chunk c from its own seed, each written atomically to
raw/ and reused by a rerun with the same sampling settings (changing only the filters or num_prompts draws nothing
new that is already there).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, Optional

from align.config import Recipe, RecipeError
from align.config_inputs import PromptsSection

MANIFEST = "manifest.json"
PROMPTS_FILE = "prompts.jsonl"
WHY = ("Magpie: the verifier's own requests, sampled from its chat template's user turn. In distribution for the "
       "verifier a drafter is aligned to, under the verifier's own licence, and no dataset is read, so no benchmark "
       "item (GSM8K, HumanEval, Spec-Bench) can be a training prompt.")
# The filters, in the order they are tried: a sample is counted under the first that refuses it.
REASONS = ("cut_short", "special_tokens", "too_short", "not_ascii", "repetitive", "duplicate", "near_duplicate")
# Loops show only in longer prompts: a 5-word request may well repeat a word.
LOOP_MIN_WORDS = 8


# --------------------------------------------------------------------------------------------------------------------
# filters
# --------------------------------------------------------------------------------------------------------------------
def words_of(text: str) -> list[str]:
    return re.findall(r"\w+", text.casefold())


def _shingles(words: list[str]) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + 3]) for i in range(max(len(words) - 2, 1))}


@dataclass
class Filter:
    """The kept prompts so far, and why the others were dropped. Deterministic: the same samples offered in the same
    order keep the same prompts."""

    settings: PromptsSection
    kept: list[str] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)
    _seen: set[str] = field(default_factory=set)
    _shingles: list[set[tuple[str, ...]]] = field(default_factory=list)
    _index: dict[tuple[str, ...], list[int]] = field(default_factory=dict)  # shingle -> kept prompts holding it

    def reason(self, text: str, ended: bool, special: bool) -> Optional[str]:
        """Why a sample is dropped (one of REASONS), or None to keep it."""
        p = self.settings
        words = words_of(text)
        if not ended:
            return "cut_short"
        if special:  # a role marker inside the message: the verifier started another turn, not a request
            return "special_tokens"
        if len(words) < p.min_words:
            return "too_short"
        if sum(ch.isascii() and (ch.isprintable() or ch in "\n\t") for ch in text) < p.min_ascii * len(text):
            return "not_ascii"
        if len(words) >= LOOP_MIN_WORDS and len(set(words)) < p.min_distinct_words * len(words):
            return "repetitive"
        if " ".join(words) in self._seen:
            return "duplicate"
        mine = _shingles(words)
        candidates = {k for s in mine for k in self._index.get(s, ())}
        if any(len(mine & self._shingles[k]) >= p.near_duplicate * len(mine | self._shingles[k]) for k in candidates):
            return "near_duplicate"
        return None

    def offer(self, text: str, ended: bool, special: bool) -> bool:
        """Keep the sample unless a filter refuses it; True when kept."""
        why = self.reason(text, ended, special)
        if why is not None:
            self.dropped[why] += 1
            return False
        words = words_of(text)
        self._seen.add(" ".join(words))
        self._shingles.append(_shingles(words))
        for s in self._shingles[-1]:
            self._index.setdefault(s, []).append(len(self.kept))
        self.kept.append(text)
        return True


# --------------------------------------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """What the stage samples from: the tokenizer, the user turn's prefixes (text and ids, one per system prompt of
    prompts.system_prompts), the tokens that end the message, and the sampling settings raw chunks are made with (and
    their hash)."""

    tokenizer: Any
    template: str
    prefixes: list[str]
    prefix_ids: list[list[int]]
    stop_ids: list[int]
    settings: dict[str, Any]
    settings_hash: str


def _verifier_weights(path: str) -> Optional[str]:
    """The verifier's weights' sha256 as align convert recorded it (None for a folder it did not write)."""
    try:
        return json.loads((Path(path) / "manifest.json").read_text())["files"]["model.safetensors"]["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _generation_eos(path: str) -> list[int]:
    from transformers import GenerationConfig

    try:
        found = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        return []
    return [] if found is None else [found] if isinstance(found, int) else list(found)


def plan(recipe: Recipe) -> Plan:
    """Everything the stage needs before sampling, checked (cli's Stage.check runs it): the verifier's tokenizer has a
    chat template whose user turn can be read off, and prompts.out holds no samples of other settings."""
    from align.chat import end_of_turn_ids, user_turn
    from align.data import chat_template, template_sha256
    from align.models import load_tokenizer

    v, p = recipe.verifier, recipe.prompts
    if recipe.data.chat_template == "off":
        raise RecipeError("data.chat_template: off, but Magpie samples a user's message from the chat template "
                          "(set it to auto or on)")
    tokenizer = load_tokenizer(v.path, v.trust_remote_code)
    if not tokenizer.chat_template:
        raise RecipeError(f"verifier.path: the tokenizer of {v.path} has no chat template; Magpie samples a user's "
                          "message from one (an instruct model's)")
    template = chat_template(tokenizer, "on", v.path)
    prefixes = [user_turn(tokenizer, template, system)[0] for system in p.system_prompts]
    for system, prefix in zip(p.system_prompts, prefixes):
        if system is not None and system not in prefix:  # some templates drop a system message, or re-word it
            raise RecipeError(f"prompts.system_prompts: the chat template of {v.path} does not render the system "
                              f"message {system[:40]!r} as it is given, so it cannot steer the user's message")
    prefix_ids = [tokenizer(prefix, add_special_tokens=False).input_ids for prefix in prefixes]
    stop_ids = sorted(set(end_of_turn_ids(tokenizer, template)) | set(_generation_eos(v.path)) |
                      ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()))
    if not stop_ids:
        raise RecipeError(f"verifier.path: the tokenizer of {v.path} has no token that ends a turn (no eos, no special "
                          "token after a user message), so a sampled message would never end")
    settings = {"verifier": v.path, "verifier_weights_sha256": _verifier_weights(v.path), "dtype": v.dtype,
                "chat_template_sha256": template_sha256(template), "system_prompts": p.system_prompts,
                "prefix_ids": prefix_ids, "stop_ids": stop_ids,
                "temperature": p.temperature, "top_p": p.top_p, "max_new_tokens": p.max_new_tokens,
                "batch_size": p.batch_size, "seed": p.seed,
                # only when not HF's: folders sampled before there was a choice keep their hash
                **({"backend": p.backend} if p.backend != "hf" else {})}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    made = _read_json(Path(p.out) / MANIFEST)
    if made is not None and made.get("settings_hash") != digest:
        raise RecipeError(f"prompts.out: {p.out} holds samples drawn with other settings (verifier, template or "
                          "sampling); choose another folder or delete it")
    check_raw_chunks(Path(p.out), digest)
    return Plan(tokenizer, template, prefixes, prefix_ids, stop_ids, settings, digest)


def samples_sha256(samples: list[dict[str, Any]]) -> str:
    """What a raw chunk records of its samples, so that an edited or damaged chunk is never read as the verifier's."""
    return hashlib.sha256(json.dumps(samples, sort_keys=True).encode()).hexdigest()


def check_raw_chunks(out: Path, settings_hash: str) -> None:
    """Every raw chunk already in prompts.out is whole, of these settings and as it was written: refused in one line
    naming the chunk, before any sampling (a torn or missing manifest let chunks of other settings be sampled over,
    and an edited chunk that was still JSON became training data). Chunks from before the checksum have none."""
    for path in sorted((out / "raw").glob("chunk-*.json")):
        chunk = _read_json(path)
        samples = chunk.get("samples") if isinstance(chunk, dict) else None
        if not isinstance(samples, list) or not all(isinstance(s, dict) and {"ids", "ended", "text"} <= s.keys()
                                                      for s in samples):
            raise RecipeError(f"prompts.out: {path} is not a chunk of samples (damaged or edited); delete it to "
                              "sample it again")
        if chunk.get("settings_hash") != settings_hash:
            raise RecipeError(f"prompts.out: {path} holds samples drawn with other settings (verifier, template or "
                              "sampling); choose another folder or delete it")
        if "samples_sha256" in chunk and chunk["samples_sha256"] != samples_sha256(samples):
            raise RecipeError(f"prompts.out: {path} is not as it was written (its samples' sha256 differs); delete it "
                              "to sample it again")


def models(recipe: Recipe) -> tuple[str, ...]:
    return ("verifier.path",)


def check(recipe: Recipe) -> None:
    """The recipe and the verifier (its chat template, the system prompts it renders: `plan`) first, then the machine
    (vLLM's environment), so that a recipe's refusal is the same whichever environments this checkout has."""
    plan(recipe)
    if recipe.prompts.backend == "vllm":
        from align.vllm_engine import vllm_python

        vllm_python("prompts.backend")


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def sample_chunk(verifier: Any, plan_: Plan, p: PromptsSection, chunk: int, seed: int) -> list[dict[str, Any]]:
    """prompts.batch_size user messages sampled after the chunk's prefix (its system prompt's), each cut at its first
    stop token: {ids (the message's tokens), ended (a stop token came within max_new_tokens)}."""
    import torch

    torch.manual_seed(seed)
    pad = plan_.tokenizer.pad_token_id
    prefix_ids = plan_.prefix_ids[chunk % len(plan_.prefix_ids)]
    ids = torch.tensor([prefix_ids], device=verifier.device).expand(p.batch_size, -1)
    with torch.inference_mode():
        out = verifier.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=p.temperature,
                                top_p=p.top_p, top_k=0, max_new_tokens=p.max_new_tokens, eos_token_id=plan_.stop_ids,
                                pad_token_id=plan_.stop_ids[0] if pad is None else pad)
    return cut_at_stop(out[:, ids.shape[1]:].tolist(), plan_.stop_ids)


def cut_at_stop(rows: list[list[int]], stop_ids: list[int]) -> list[dict[str, Any]]:
    """Each sampled row cut at its first stop token: {ids (the message's tokens), ended (a stop token came)}."""
    samples = []
    for row in rows:
        end = next((i for i, t in enumerate(row) if t in stop_ids), None)
        samples.append({"ids": row if end is None else row[:end], "ended": end is not None})
    return samples


def sample_chunk_vllm(runner: Any, plan_: Plan, p: PromptsSection, chunk: int, seed: int) -> list[dict[str, Any]]:
    """`sample_chunk`'s samples from vLLM: prompts.batch_size completions of the chunk's prefix (sample j drawn with
    seed · batch_size + j), each cut at its first stop token."""
    prefix_ids = plan_.prefix_ids[chunk % len(plan_.prefix_ids)]
    # vLLM seeds sample j with seed + j: chunk seeds one apart would share all but one of their samples' seeds (and
    # chunks c and c + 3 their prefix): every sample of one seed space of its own.
    out = runner.generate([prefix_ids], max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
                          n=p.batch_size, seed=seed * p.batch_size, stop_token_ids=plan_.stop_ids)
    return cut_at_stop([c.token_ids for c in out.completions[0]], plan_.stop_ids)


def start_engine(recipe: Recipe) -> Any:
    """What samples: the verifier loaded by transformers, or a vLLM worker serving it (backend vllm), in the dtype
    and on the device align would load it with."""
    from align.models import load_verifier
    from align.vllm_engine import verifier_runner

    if recipe.prompts.backend == "hf":
        return load_verifier(recipe.verifier)
    return verifier_runner(recipe, kv_cache_gib=recipe.prompts.vllm_cpu_kv_cache_gib, seed=recipe.prompts.seed,
                           key="prompts.backend")


def main(recipe: Recipe, command: str) -> int:
    from tqdm.auto import tqdm

    from align.chat import special_ids
    from align.disk import mark_folder, write_text_atomic
    from align.vllm_engine import VllmRunner

    p = recipe.prompts
    t0 = time.perf_counter()
    plan_ = plan(recipe)
    tokenizer, out = plan_.tokenizer, mark_folder(p.out, "prompts")  # after every check: marked as align's
    specials = special_ids(tokenizer)
    max_samples = p.max_samples or 4 * p.num_prompts
    keep = Filter(p)
    engine, drawn, sampled, sampling_s, sources = None, 0, 0, 0.0, []
    bar = tqdm(total=p.num_prompts, desc="prompts (Magpie)", unit="prompt", dynamic_ncols=True)
    try:
        for c in range(math.ceil(max_samples / p.batch_size)):
            if len(keep.kept) >= p.num_prompts:
                break
            path = out / "raw" / f"chunk-{c:05d}.json"
            chunk = _read_json(path)
            if chunk is None:  # plan() checked every chunk already there: whole, and of these settings
                if engine is None:  # only when something is left to sample: a finished run loads no model
                    engine = start_engine(recipe)
                seed = p.seed * 1_000_003 + c
                started = time.perf_counter()
                sample = sample_chunk_vllm if isinstance(engine, VllmRunner) else sample_chunk
                samples = sample(engine, plan_, p, c, seed)
                sampling_s += time.perf_counter() - started
                for s in samples:
                    s["text"] = tokenizer.decode(s["ids"]).strip()
                chunk = {"settings_hash": plan_.settings_hash, "chunk": c, "seed": seed, "samples": samples,
                         "samples_sha256": samples_sha256(samples)}
                write_text_atomic(path, json.dumps(chunk))
                sampled += len(samples)
            kept_before = len(keep.kept)
            for k, s in enumerate(chunk["samples"]):
                if drawn >= max_samples or len(keep.kept) >= p.num_prompts:
                    break
                drawn += 1
                if keep.offer(s["text"], s["ended"], any(t in specials for t in s["ids"])):
                    sources.append(c * p.batch_size + k)
            # One update a chunk: per prompt, the first (after the engine's start and a whole chunk) set tqdm's rate
            # to a minute a prompt and its estimate to 45 hours, where the stage took 15 minutes.
            bar.set_postfix(drawn=drawn, refused=sum(keep.dropped.values()), refresh=False)
            bar.update(len(keep.kept) - kept_before)
    finally:
        bar.close()
        if isinstance(engine, VllmRunner):
            engine.close()
    rows = [{"id": f"magpie-{p.seed}-{index:06d}", "messages": [{"role": "user", "content": text}]}
            for index, text in zip(sources, keep.kept)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    write_text_atomic(out / PROMPTS_FILE, text)
    seconds = time.perf_counter() - t0
    manifest = {
        "stage": "prompts", "method": "magpie", "why": WHY, "command": command,
        "data_read": "none: every prompt is a sample of the verifier's (no dataset, so no benchmark item)",
        "verifier": recipe.verifier.path, "user_turn_prefixes": plan_.prefixes,
        "settings_hash": plan_.settings_hash, "settings": plan_.settings,
        "filters": {k: getattr(p, k) for k in ("min_words", "min_ascii", "min_distinct_words", "near_duplicate")},
        "counts": {"asked": p.num_prompts, "kept": len(rows), "samples_drawn": drawn, "sampled_this_run": sampled,
                   "max_samples": max_samples},
        "dropped": {why: keep.dropped[why] for why in REASONS},
        # prompt k came from chunk sources[k] // batch_size, sampled after that chunk's system prompt
        "kept_per_system_prompt": [sum(i // p.batch_size % len(plan_.prefixes) == k for i in sources)
                                   for k in range(len(plan_.prefixes))],
        "prompts_file_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "engine": (f"vllm {engine.version}" if isinstance(engine, VllmRunner) else
                   f"{p.backend} (nothing sampled this run)" if engine is None else
                   f"transformers {version('transformers')}"),
        "seconds_this_run": round(seconds, 1),
        "sampling_seconds_this_run": round(sampling_s, 1),
    }
    write_text_atomic(out / MANIFEST, json.dumps(manifest, indent=2))
    rate = f", {sampled / sampling_s:.2f} samples/s" if sampled else ", nothing new sampled"
    dropped = ", ".join(f"{why} {n}" for why, n in manifest["dropped"].items() if n) or "none"
    print(f"prompts: kept {len(rows)} of {drawn} samples ({sampled} sampled this run{rate}; dropped: {dropped}) "
          f"-> {out / PROMPTS_FILE}")
    if len(rows) < p.num_prompts:
        print(f"prompts: warning: only {len(rows)} of the {p.num_prompts} prompts asked for passed the filters in "
              f"{max_samples} samples (prompts.max_samples); raise it or relax the filters")
    return 0
