"""`align trajectories`: the verifier samples completions of training prompts, stored as `datasets` Arrow chunks.

Chunks of `trajectories.batch_size` prompts are spread over ranks (launched with several processes, each takes every
WORLD_SIZE-th chunk), written atomically, and skipped when already done, so an interrupted run resumes without
duplicating work. Each chunk's files are checksummed in the manifest; loading checks them and names a corrupted file.
"""

from __future__ import annotations

import hashlib
import json
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

from align.config import Recipe, RecipeError
from align.recipe_files import get_key
from align.data import (TRAJECTORY_KEYS, TRAJECTORY_MANIFEST, chat_template, load_prompts, mixture_counts,
                        prompt_ids_sha256, render_prompt, template_sha256, tiny_prompts_path, verifier_end_tokens)
from align.decoding.generation import truncate
from align.disk import atomic_folder, file_sha256, mark_folder, write_text_atomic
from align.dist import check_shared_folder, end_ranks, rank_and_world, wait_for_every_rank
from align.models import load_tokenizer, load_verifier
from align.preflight import check_context, check_inputs, check_new_tokens, model_context
from align.vllm_engine import VllmRunner, verifier_runner, vllm_python


# Recipe key -> its name in the manifest's settings: with the prompts (the keys of PROMPT_KEYS decide which, and how
# they are rendered), what makes a set of trajectories; a folder holds one set.
SETTING_KEYS: dict[str, str] = {
    **TRAJECTORY_KEYS,  # what align train compares with its own recipe (verifier, temperature, top_p, max_new_tokens)
    "trajectories.completions_per_prompt": "completions_per_prompt", "trajectories.store_topk": "store_topk",
    "trajectories.batch_size": "batch_size", "trajectories.backend": "backend", "train.seed": "seed",
}
PROMPT_KEYS = ("trajectories.num_prompts", "trajectories.max_prompt_tokens", "data.train_prompts", "data.train_split",
               "data.prompt_column", "data.chat_template", "data.dir")


def settings_of(recipe: Recipe, prompt_ids: list[list[int]], template: Optional[str],
                end_tokens: list[int]) -> dict[str, Any]:
    return {
        **{name: get_key(recipe, key) for key, name in SETTING_KEYS.items()},
        "num_prompts": len(prompt_ids),
        # which prompts each chunk holds (chunk_order): a folder written in another order is another set of chunks
        "chunk_order": "longest_first",
        # the token ids the verifier read, and the chat template that rendered them (align train compares it)
        "prompts_sha256": prompt_ids_sha256(prompt_ids), "chat_template_sha256": template_sha256(template),
        # where each completion stopped (data.eos_token_ids, as eval stops; align train compares it)
        "end_token_ids": end_tokens,
    }


# How top-k is stored: log-probs as float16 (Arrow's halffloat; Arrow has no bfloat16). A top-k log-prob lies in
# [-65504, 0], where float16's 11-bit significand keeps it to 2^-11 relative (5e-4 at -1, 0.01 at -20), 8 times finer
# than bfloat16's, whose wider exponent range buys nothing here; ids as int32 (every vocabulary is under 2^31).
TOPK_LOGPROB_DTYPE, TOPK_ID_DTYPE = "float16", "int32"


class StepTopK(LogitsProcessor):
    """The verifier's own top-k log-probs (temperature 1, before sampling's warpers) at every step of generate(), kept
    as the loop runs, so that no step's full-vocabulary logits outlive it (output_logits keeps every step's, fp32:
    steps × batch × vocab × 4 bytes, ~80 GB per chunk of a 152k-vocabulary model).

    A forward hook on the verifier takes the top-k of each forward's last position, the logits generate() samples
    from; generate() calls the processor once per step, after that step's forward(s), and it copies that step's top-k
    into buffers made once for all steps. (A processor alone would see the scores after the temperature and top-p
    warpers: custom processors run last. Small tensors kept step by step would pin the allocator's heap between each
    step's vocabulary-sized temporaries: +120 MB over 96 steps of a 131k vocabulary on a CPU, measured.)"""

    def __init__(self, verifier: Any, k: int, max_steps: int) -> None:
        self.k, self.max_steps, self.steps = k, max_steps, 0
        self.latest: Any = None  # the last forward's top-k: (B, k) values and indices
        self.logprobs: Optional[torch.Tensor] = None  # (B, max_steps, k) float16, made at the first step
        self.ids: Optional[torch.Tensor] = None  # (B, max_steps, k) int32
        self.hook = verifier.register_forward_hook(self._keep_topk)

    def _keep_topk(self, module: Any, args: Any, output: Any) -> None:
        self.latest = torch.log_softmax(output.logits[:, -1].float(), -1).topk(self.k, dim=-1)  # best first

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        values, indices = self.latest
        if self.logprobs is None:
            shape = (values.shape[0], self.max_steps, self.k)
            self.logprobs = torch.empty(shape, dtype=getattr(torch, TOPK_LOGPROB_DTYPE), device=values.device)
            self.ids = torch.empty(shape, dtype=getattr(torch, TOPK_ID_DTYPE), device=values.device)
        self.logprobs[:, self.steps] = values
        self.ids[:, self.steps] = indices
        self.steps += 1
        return scores

    def stacked(self) -> tuple[np.ndarray, np.ndarray]:
        """(B, steps, k) log-probs (float16) and ids (int32) of every step, on the CPU."""
        assert self.logprobs is not None and self.ids is not None, "generate() made no step"
        return self.logprobs[:, : self.steps].cpu().numpy(), self.ids[:, : self.steps].cpu().numpy()


@torch.inference_mode()
def sample_chunk(verifier: Any, tokenizer: Any, prompt_ids: list[list[int]], recipe: Recipe, seed: int,
                 end_tokens: frozenset[int]) -> list[dict[str, Any]]:
    """Completions of a batch of rendered prompts (data.render_prompt), `completions_per_prompt` each, by HF
    generate() (batched, left-padded), each stopped at its first end token (`end_tokens`, kept)."""
    t = recipe.trajectories
    tokenizer.padding_side = "left"  # generation appends on the right: padding must not sit between prompt and text
    batch = tokenizer.pad({"input_ids": prompt_ids}, padding=True, return_tensors="pt").to(verifier.device)
    torch.manual_seed(seed)
    sample = dict(do_sample=True, temperature=t.temperature, top_p=t.top_p, top_k=0) if t.temperature > 0 else dict(
        do_sample=False, temperature=None, top_p=None, top_k=None)  # greedy: sampling flags would only draw warnings
    topk = StepTopK(verifier, t.store_topk, t.max_new_tokens) if t.store_topk else None
    try:
        sequences = verifier.generate(
            **batch, **sample,
            max_new_tokens=t.max_new_tokens, num_return_sequences=t.completions_per_prompt,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=sorted(end_tokens) or None,
            logits_processor=LogitsProcessorList([topk] if topk else []),
        )
    finally:
        if topk is not None:
            topk.hook.remove()
    width = batch.input_ids.shape[1]
    if topk is not None:
        logprobs, ids = topk.stacked()  # (B·n, steps, k)
    rows = []
    for r, sequence in enumerate(sequences):
        prompt_row = r // t.completions_per_prompt
        prompt_ids = batch.input_ids[prompt_row][batch.attention_mask[prompt_row].bool()].tolist()
        completion = truncate(sequence[width:].tolist(), t.max_new_tokens, end_tokens)  # then padding
        row: dict[str, Any] = {"prompt_ids": prompt_ids, "completion_ids": completion}
        if topk is not None:
            row["topk_ids"], row["topk_logprobs"] = ids[r, : len(completion)], logprobs[r, : len(completion)]
        rows.append(row)
    return rows


def out_of_memory(error: BaseException) -> bool:
    """An allocation that failed: CUDA's (torch.OutOfMemoryError) or the CPU allocator's, a plain RuntimeError."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(error))


def sample_fitting(verifier: Any, tokenizer: Any, prompt_ids: list[list[int]], recipe: Recipe, seed: int,
                   end_tokens: frozenset[int], where: str, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """`sample_chunk`'s rows and how many times the batch was split: a batch that runs out of memory is retried as
    two halves (each its own generate() call and seed, seed + its first prompt's offset in the chunk, so that sampled
    completions of a split chunk differ from an unsplit one's; greedy ones do not), said on the console. One prompt
    that does not fit is refused in one line, naming the cap that leaves it out; the chunks written stay."""
    try:
        return sample_chunk(verifier, tokenizer, prompt_ids, recipe, seed + offset, end_tokens), 0
    except RuntimeError as error:  # torch.OutOfMemoryError is one
        if not out_of_memory(error):
            raise
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the failed batch's blocks, before the halves allocate theirs
    longest = max(map(len, prompt_ids))
    if len(prompt_ids) == 1:
        raise RecipeError(f"trajectories.max_prompt_tokens: {where}: one prompt of {longest} tokens with "
                          f"{recipe.trajectories.completions_per_prompt} completion(s) of up to "
                          f"{recipe.trajectories.max_new_tokens} tokens runs out of memory on {verifier.device}; set "
                          f"trajectories.max_prompt_tokens below {longest} to leave such prompts out, then rerun "
                          "(the chunks written are kept)")
    half = len(prompt_ids) // 2
    tqdm.write(f"trajectories: {where}: {len(prompt_ids)} prompts (the longest {longest} tokens) ran out of memory; "
               f"retrying as {half} and {len(prompt_ids) - half}")
    first, first_splits = sample_fitting(verifier, tokenizer, prompt_ids[:half], recipe, seed, end_tokens, where,
                                         offset)
    second, second_splits = sample_fitting(verifier, tokenizer, prompt_ids[half:], recipe, seed, end_tokens, where,
                                           offset + half)
    return first + second, 1 + first_splits + second_splits


def chunk_order(prompt_ids: list[list[int]], max_prompt_tokens: Optional[int]) -> tuple[list[int], int]:
    """(the indices of the prompts to sample, longest first, ties in order; how many were left out for having more
    than max_prompt_tokens tokens). Longest first: a chunk's prompts are padded to lengths alike, and a batch too
    large for the memory is met in the first chunk, not hours in."""
    kept = [i for i, ids in enumerate(prompt_ids) if max_prompt_tokens is None or len(ids) <= max_prompt_tokens]
    return sorted(kept, key=lambda i: (-len(prompt_ids[i]), i)), len(prompt_ids) - len(kept)


def start_vllm(recipe: Recipe) -> VllmRunner:
    """The verifier in a vLLM worker, in the dtype and on the device align would load it with."""
    return verifier_runner(recipe, kv_cache_gib=recipe.trajectories.vllm_cpu_kv_cache_gib, seed=recipe.train.seed,
                           key="trajectories.backend")


def sample_chunk_vllm(runner: VllmRunner, tokenizer: Any, prompt_ids: list[list[int]], recipe: Recipe,
                      seed: int, end_tokens: frozenset[int]) -> list[dict[str, Any]]:
    """The rows `sample_chunk` makes, from vLLM: it reads the same rendered token ids (it never sees a tokenizer),
    each completion ends at its first end token (kept), the top-k log-probs are the verifier's own, as HF's."""
    t = recipe.trajectories
    out = runner.generate(prompt_ids, max_new_tokens=t.max_new_tokens, temperature=t.temperature,
                          top_p=t.top_p if t.temperature > 0 else 1.0, n=t.completions_per_prompt, seed=seed,
                          logprobs=t.store_topk, stop_token_ids=sorted(end_tokens))
    rows = []
    for ids, samples in zip(prompt_ids, out.completions):  # prompt-major, as generate()'s num_return_sequences
        for sample in samples:
            completion = truncate(sample.token_ids, t.max_new_tokens, end_tokens)
            row: dict[str, Any] = {"prompt_ids": list(ids), "completion_ids": completion}
            if t.store_topk:
                row["topk_ids"] = np.asarray(sample.topk_ids[: len(completion)], dtype=TOPK_ID_DTYPE)
                row["topk_logprobs"] = np.asarray(sample.topk_logprobs[: len(completion)], dtype=TOPK_LOGPROB_DTYPE)
            rows.append(row)
    return rows


def chunk_features(rows: list[dict[str, Any]]) -> Any:
    """The Arrow types of a chunk's columns: top-k as (completion, k) lists of int32 ids and float16 log-probs."""
    from datasets import Features, List, Value

    types = {"prompt_ids": List(Value("int64")), "completion_ids": List(Value("int64")),
             "topk_ids": List(List(Value(TOPK_ID_DTYPE))), "topk_logprobs": List(List(Value(TOPK_LOGPROB_DTYPE))),
             "prompt_index": Value("int64")}
    return Features({name: types[name] for name in rows[0]})


def write_chunk(rows: list[dict[str, Any]], folder: Path, settings_hash: str, splits: int = 0) -> None:
    """Write a chunk atomically, with its files' checksums (and how often its batch was split to fit the memory)."""
    from datasets import Dataset

    with atomic_folder(folder, "trajectories") as tmp:
        Dataset.from_list(rows, features=chunk_features(rows)).save_to_disk(str(tmp))
        checksums = {p.name: file_sha256(p) for p in sorted(tmp.glob("*.arrow"))}
        tokens = sum(len(r["completion_ids"]) for r in rows)
        (tmp / "chunk.json").write_text(json.dumps({"settings": settings_hash, "rows": len(rows), "tokens": tokens,
                                                    "sha256": checksums, "out_of_memory_splits": splits}))


def chunk_done(folder: Path, settings_hash: str) -> bool:
    try:
        return json.loads((folder / "chunk.json").read_text())["settings"] == settings_hash
    except (OSError, json.JSONDecodeError, KeyError):
        return False


def prompt_sources(recipe: Recipe, source: Union[str, list[Any]]) -> Union[str, list[dict[str, Any]]]:
    """What the manifest records of the prompts read: the source, or a mixture's sources, each with how many of the
    trajectories' prompts it gave."""
    if isinstance(source, str):
        return source
    counts = mixture_counts(recipe.trajectories.num_prompts, [s.weight for s in source])
    return [{**s.model_dump(mode="json"), "num_prompts": count} for s, count in zip(source, counts)]


def models(recipe: Recipe) -> tuple[str, ...]:
    return ("verifier.path",)


def prompts(recipe: Recipe) -> tuple[tuple[str, str], ...]:
    return (("data.train_prompts", "verifier.path"),)


def check(recipe: Recipe) -> None:
    """`align trajectories`'s checks beyond its models': room for a prompt in the verifier's context, and with
    backend vllm, vLLM's environment."""
    check_new_tokens(recipe, "trajectories.max_new_tokens", ("verifier.path",))
    if recipe.trajectories.backend == "vllm":
        vllm_python()


def main(recipe: Recipe, command: str) -> None:
    t = recipe.trajectories
    check_inputs(recipe, model_keys=("verifier.path",))
    if t.backend == "vllm":
        vllm_python()  # vLLM's environment is there, before any work
    source = recipe.data.train_prompts or tiny_prompts_path(recipe, "train", recipe.verifier.path)
    tokenizer = load_tokenizer(recipe.verifier.path, recipe.verifier.trust_remote_code)
    template = chat_template(tokenizer, recipe.data.chat_template, recipe.verifier.path)
    prompts = [render_prompt(tokenizer, p, template) for p in load_prompts(recipe, "data.train_prompts", source)]
    order, too_long = chunk_order(prompts, t.max_prompt_tokens)
    if not order:
        raise RecipeError(f"trajectories.max_prompt_tokens: all {len(prompts)} prompts are longer than "
                          f"{t.max_prompt_tokens} tokens (the shortest has {min(map(len, prompts))})")
    if too_long:
        print(f"trajectories: {too_long} of {len(prompts)} prompts left out, longer than trajectories.max_prompt_tokens"
              f"={t.max_prompt_tokens} tokens (the longest {max(map(len, prompts))})")
    # The verifier's context bounds each prompt and its completion, as in every stage (eval refuses the same prompts),
    # checked from its config before it loads: training on a continuation past it would teach degraded text.
    context, _ = model_context(recipe, ("verifier.path",))
    kept = sorted(order)  # in data.train_prompts' order, as the settings record them
    for i in kept:
        check_context(f"data.train_prompts: prompt {i}", len(prompts[i]), "trajectories.max_new_tokens",
                      t.max_new_tokens, context, "the verifier's")
    end_tokens = verifier_end_tokens(recipe, tokenizer)  # from its files: vLLM loads no HF model
    settings = settings_of(recipe, [prompts[i] for i in kept], template, end_tokens)
    settings_hash = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    out = Path(t.out)
    old = out / TRAJECTORY_MANIFEST
    if old.is_file() and json.loads(old.read_text()).get("settings_hash") != settings_hash:
        raise RecipeError(f"trajectories.out: {out} holds trajectories made with other settings; "
                          "choose another folder or delete it")
    rank, world = rank_and_world()
    check_shared_folder(out, "trajectories.out", rank, world)  # rank 0 reads every rank's chunks
    mark_folder(out, "trajectories")  # every check passed
    verifier = start_vllm(recipe) if t.backend == "vllm" else load_verifier(recipe.verifier)
    starts = list(range(0, len(order), t.batch_size))
    mine = [c for c in range(len(starts)) if c % world == rank]
    todo = [c for c in mine if not chunk_done(out / "chunks" / f"chunk-{c:05d}", settings_hash)]
    t0 = time.perf_counter()
    for c in tqdm(todo, desc=f"trajectories (rank {rank})", unit="chunk", disable=rank != 0, dynamic_ncols=True,
                  initial=len(mine) - len(todo), total=len(mine)):
        indices = order[starts[c] : starts[c] + t.batch_size]  # prompt_index: the prompt's place in data.train_prompts
        chunk_prompts, seed = [prompts[i] for i in indices], recipe.train.seed * 1_000_003 + c
        if t.backend == "vllm":  # vLLM schedules its own batches within its KV cache
            rows, splits = sample_chunk_vllm(verifier, tokenizer, chunk_prompts, recipe, seed=seed,
                                             end_tokens=frozenset(end_tokens)), 0
        else:
            rows, splits = sample_fitting(verifier, tokenizer, chunk_prompts, recipe, seed, frozenset(end_tokens),
                                          f"chunk {c}")
        for k, row in enumerate(rows):
            row["prompt_index"] = indices[k // t.completions_per_prompt]
        write_chunk(rows, out / "chunks" / f"chunk-{c:05d}", settings_hash, splits)
    if isinstance(verifier, VllmRunner):  # (after an error, the worker ends by itself when this process does)
        verifier.close()
    wait_for_every_rank(world)  # every rank's chunks are on disk before rank 0 writes the manifest
    if rank == 0:
        chunks = {f"chunk-{c:05d}": json.loads((out / "chunks" / f"chunk-{c:05d}" / "chunk.json").read_text())
                  for c in range(len(starts))}
        manifest = {"settings_hash": settings_hash, "settings": settings, "prompts": prompt_sources(recipe, source),
                    "command": command,
                    "prompt_split": recipe.data.train_split, "prompt_column": recipe.data.prompt_column,
                    "chat_template": recipe.data.chat_template, "end_token_ids": end_tokens,
                    "topk_dtypes": {"ids": TOPK_ID_DTYPE, "logprobs": TOPK_LOGPROB_DTYPE} if t.store_topk else None,
                    "prompts_left_out": {"longer_than_max_prompt_tokens": too_long},
                    "out_of_memory_splits": sum(c.get("out_of_memory_splits", 0) for c in chunks.values()),
                    "rows": sum(c["rows"] for c in chunks.values()),
                    "completion_tokens": sum(c["tokens"] for c in chunks.values()),
                    "chunks": {name: c["sha256"] for name, c in chunks.items()},
                    "engine": f"vllm {verifier.version}" if isinstance(verifier, VllmRunner) else
                              f"transformers {version('transformers')}",
                    "seconds_this_run": round(time.perf_counter() - t0, 1)}
        write_text_atomic(out / TRAJECTORY_MANIFEST, json.dumps(manifest, indent=2))
        # Tokens/s of this run's generation (model loading left out), when one process made them all.
        made = sum(chunks[f"chunk-{c:05d}"]["tokens"] for c in todo)
        seconds = time.perf_counter() - t0
        rate = f", {made / seconds:.0f} tokens/s this run" if made and world == 1 else ""
        print(f"trajectories: {manifest['rows']} completions, {manifest['completion_tokens']} tokens "
              f"({manifest['engine']}{rate}) -> {out}")
    end_ranks(world)

