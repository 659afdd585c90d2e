"""`align calibrate`: run vanilla dLLM decoding on 20-50 prompts and write the Spiffy draft graph it implies."""

from __future__ import annotations

import sys
import time

import torch
from tqdm.auto import tqdm

from align.config import Recipe, RecipeError
from align.data import (chat_template, load_prompts, prompt_ids_sha256, render_prompt, template_sha256,
                        tiny_prompts_path)
from align.decoding.dllm import BlockTrace, dllm_generate
from align.disk import mark_folder
from align.checkpoint import weights_sha256_of
from align.draft_graph import POSITION_ORDERS, calibrate
from align.drafters.loading import load_drafter
from align.methods import eos_token_ids
from align.models import load_tokenizer
from align.preflight import check_decodes_alone, check_new_tokens, fits_context, model_context


def models(recipe: Recipe) -> tuple[str, ...]:
    return ("drafter.path",)


def prompts(recipe: Recipe) -> tuple[tuple[str, str], ...]:
    return (("calibrate.prompts", "drafter.path"),)


# Below this many prompts a draft graph is calibrated on too few traces to say anything of other prompts (Spiffy
# calibrates on 20-50); said, not refused: a quick look at a drafter is a fair use.
FEW_PROMPTS = 10


def check(recipe: Recipe) -> None:
    """`align calibrate`'s checks beyond its models': the new tokens leave room for a prompt in the drafter's
    context (each prompt is checked by the stage, before the drafter's weights load), and it decodes alone."""
    check_decodes_alone(recipe, "align calibrate")
    check_new_tokens(recipe, "decode.max_new_tokens", ("drafter.path",))


def main(recipe: Recipe, command: str) -> None:
    c = recipe.calibrate
    path = c.prompts or tiny_prompts_path(recipe, "train", recipe.drafter.path)
    prompts = load_prompts(recipe, "calibrate.prompts", path)
    # The dLLM decodes alone here, so its own tokenizer (and chat template) renders the prompts, as in dllm eval.
    tokenizer = load_tokenizer(recipe.drafter.path, recipe.drafter.trust_remote_code)
    template = chat_template(tokenizer, recipe.data.chat_template, recipe.drafter.path)
    prompt_ids = [render_prompt(tokenizer, p, template) for p in prompts]
    # Calibration only needs typical prompts: an over-long one (the context rule every stage applies) is skipped,
    # and when none is left the stage is refused from the drafter's config, before its weights load.
    context, _ = model_context(recipe, ("drafter.path",))
    usable = [ids for ids in prompt_ids if fits_context(len(ids), recipe.decode.max_new_tokens, context)]
    if not usable:
        raise RecipeError(f"calibrate.prompts: every prompt of {path} is too long: with decode.max_new_tokens="
                          f"{recipe.decode.max_new_tokens} none fits the drafter's context of {context} tokens "
                          f"(the shortest has {min(map(len, prompt_ids))})")
    if len(usable) < FEW_PROMPTS:
        print(f"align calibrate: warning: {len(usable)} prompt(s) to calibrate from; Spiffy's graphs are calibrated on "
              f"20-50: a graph from fewer may fit these prompts alone (calibrate.num_prompts)", file=sys.stderr)
    model, spec = load_drafter(recipe.drafter, tokenizer)
    eos_ids = eos_token_ids(model, tokenizer)
    t0 = time.perf_counter()
    traces: list[BlockTrace] = []
    nfe = context_forwards = 0
    for ids in tqdm(usable, desc="vanilla traces", unit="prompt", dynamic_ncols=True):
        prompt = torch.tensor([ids], device=model.device)  # (1, n)
        _, stats = dllm_generate(model, spec, prompt, recipe.decode.max_new_tokens, c.block_length, c.tokens_per_step,
                                 eos_ids=eos_ids, trace=traces, trace_token_rank=c.max_token_rank)
        nfe += stats.nfe
        context_forwards += stats.context_forwards
    if not traces:
        raise RecipeError(f"calibrate.prompts: no usable prompt in {path}")
    graph = calibrate(
        traces, spec.mask_token_id, c.block_length, c.budget, c.tokens_per_step, c.max_position_rank,
        c.max_token_rank, POSITION_ORDERS if c.position_order == "auto" else (c.position_order,), c.objective,
        meta={"model": recipe.drafter.path, "drafter_weights_sha256": weights_sha256_of(recipe.drafter.path),
              "drafter_spec": spec.to_dict(), "num_prompts": len(prompts),
              "prompts": path, "prompts_sha256": prompt_ids_sha256(prompt_ids),
              "chat_template_sha256": template_sha256(template),
              "max_new_tokens": recipe.decode.max_new_tokens, "vanilla_nfe": nfe, "command": command},
        context_forwards=context_forwards,
    )
    graph.meta["seconds"] = round(time.perf_counter() - t0, 1)  # tracing and the node search
    out = mark_folder(c.out, "calibrate") / "draft_graph.json"
    graph.save(out)
    replayed = ", ".join(f"{order} {x:.2f}x" for order, x in graph.meta["replayed_nfe_reduction"].items())
    print(f"calibrated {graph.budget} nodes ({graph.position_order} order; NFE reduction replayed on the traces: "
          f"{replayed}) from {len(traces)} blocks of {len(prompts)} prompts in {graph.meta['seconds']} s -> {out}")
    for k, node in enumerate(graph.nodes):
        print(f"  node {k}: {sorted(node)}  count {graph.counts[k]}  parents {graph.parents(k)}")
