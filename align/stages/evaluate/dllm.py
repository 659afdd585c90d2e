"""`align eval` with eval.mode=dllm: the drafter decoded as a diffusion LM. Vanilla block decoding against Spiffy
for each budget D, threshold (parallel) decoding, and threshold + Spiffy; all in one process, interleaved.

What eval.json holds, by `schema_version`, is in docs/evaluation.md ("What `eval.json` holds"), its only
description.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from align.bench import interleaved, report_json
from align.config import Recipe, RecipeError
from align.data import (chat_template, encode_prompts, eval_prompt_rows, prompt_ids_sha256, prompt_places,
                        template_sha256)
from align.decoding.dllm import DllmStats, dllm_generate
from align.decoding.spiffy import spiffy_generate
from align.disk import mark_folder, write_result, write_text_atomic
from align.draft_graph import DraftGraph, check_graph_drafter
from align.drafters import BATCHED_ROWS_MATCH
from align.drafters.loading import load_drafter
from align.machine import machine, versions
from align.methods import eos_token_ids
from align.models import load_tokenizer
from align.preflight import model_context


SCHEMA_VERSION = 2  # of eval.json: what each version holds is in docs/evaluation.md


def methods_for(model: Any, spec: Any, graph: DraftGraph, recipe: Recipe, eos_ids: frozenset[int]
                ) -> dict[str, tuple[str, Callable[[torch.Tensor], tuple[list[int], DllmStats]]]]:
    """name -> (the vanilla method whose outputs it must reproduce, fn(prompt_ids))."""
    c, n = recipe.calibrate, recipe.decode.max_new_tokens
    methods: dict[str, tuple[str, Callable]] = {
        "vanilla": ("vanilla", lambda ids: dllm_generate(model, spec, ids, n, c.block_length, c.tokens_per_step,
                                                         eos_ids=eos_ids)),
        "threshold": ("threshold", lambda ids: dllm_generate(model, spec, ids, n, c.block_length, c.tokens_per_step,
                                                             threshold=c.threshold, eos_ids=eos_ids)),
    }
    for budget in recipe.eval.spiffy_budgets:
        sub = graph.prefix(budget)
        methods[f"spiffy_d{budget}"] = ("vanilla", lambda ids, g=sub: spiffy_generate(model, spec, ids, g, n,
                                                                                        eos_ids=eos_ids))
        methods[f"threshold_spiffy_d{budget}"] = ("threshold", lambda ids, g=sub: spiffy_generate(
            model, spec, ids, g, n, threshold=c.threshold, eos_ids=eos_ids))
    largest = graph.prefix(max(recipe.eval.spiffy_budgets)) if recipe.eval.spiffy_budgets else graph
    for active in recipe.eval.spiffy_active:
        methods[f"pruned_spiffy_d{largest.budget}_a{active}"] = ("vanilla", lambda ids, k=active: spiffy_generate(
            model, spec, ids, largest, n, eos_ids=eos_ids, active=k))
    return methods


def outputs_claim(attention: str, tokens: dict[str, list[list[int]]], references: dict[str, str]) -> str:
    """What eval.json and the report say about Spiffy's outputs: the token-for-token comparison with the vanilla
    method each one must reproduce, as measured, and why equality is expected but not bitwise by construction."""
    runs = [(t, r) for name, ref in references.items() if name != ref for t, r in zip(tokens[name], tokens[ref])]
    matched = sum(t == r for t, r in runs)
    why = BATCHED_ROWS_MATCH[attention]
    return (f"identical outputs measured: {matched}/{len(runs)} runs of Spiffy equal to the vanilla decoding they accelerate, token for "
            f"token (the exact_match column); expected but not bitwise by construction: {why}")


def evaluate(recipe: Recipe, command: str) -> None:
    c, e = recipe.calibrate, recipe.eval
    if c.graph is None:
        raise RecipeError("calibrate.graph: eval.mode=dllm needs a draft_graph.json (make one with align calibrate)")
    graph = DraftGraph.load(Path(c.graph), block_length=c.block_length, tokens_per_step=c.tokens_per_step)
    check_graph_drafter(graph, c.graph, recipe.drafter.path)
    for budget in e.spiffy_budgets:
        graph.prefix(budget)  # refuse a budget the graph cannot serve before any work
    tokenizer = load_tokenizer(recipe.drafter.path, recipe.drafter.trust_remote_code)
    # The dLLM decodes alone, so its own tokenizer's chat template renders the prompts (as in align calibrate).
    template = chat_template(tokenizer, recipe.data.chat_template, recipe.drafter.path)
    rows = eval_prompt_rows(recipe)
    # The drafter's config bounds the prompts: a too-long one is refused before any weights load.
    encoded = encode_prompts(tokenizer, [r.prompt for r in rows], template, recipe.decode.max_new_tokens,
                             model_context(recipe, ("drafter.path",))[0])
    model, spec = load_drafter(recipe.drafter, tokenizer)
    prompts = [ids.to(model.device) for ids in encoded]
    where = prompt_places(rows, prompts)
    eos_ids = eos_token_ids(model, tokenizer)
    methods = methods_for(model, spec, graph, recipe, eos_ids)
    names = list(methods)

    runs = interleaved({name: (lambda i, ids, fn=fn: fn(ids)) for name, (_, fn) in methods.items()}, prompts,
                       e.warmup, e.repeats, "dllm")
    tokens = {name: run.tokens for name, run in runs.items()}
    stats: dict[str, list[DllmStats]] = {name: run.stats for name, run in runs.items()}
    walls = {name: run.wall_s for name, run in runs.items()}

    vanilla_nfe, vanilla_wall = sum(s.nfe for s in stats["vanilla"]), sum(walls["vanilla"])
    summary: dict[str, dict[str, Any]] = {}
    for name in names:
        reference = tokens[methods[name][0]]
        nfe, new_tokens, wall = sum(s.nfe for s in stats[name]), sum(len(t) for t in tokens[name]), sum(walls[name])
        summary[name] = {
            "exact_match": sum(t == r for t, r in zip(tokens[name], reference)) / len(prompts),
            "exact_against": methods[name][0],
            "nfe": nfe,
            "nfe_per_token": round(nfe / max(new_tokens, 1), 4),
            "nfe_reduction": round(vanilla_nfe / nfe, 4),
            "speedup": round(vanilla_wall / wall, 4),
            "tokens_per_s": round(new_tokens / wall, 2),
            "accepted_drafts": sum(s.accepted_drafts for s in stats[name]),
            "context_forwards": sum(s.context_forwards for s in stats[name]),
            "new_tokens": new_tokens,
            "wall_s": round(wall, 4),
            "records": [{**w, "new_tokens": len(t), "nfe": st.nfe, "steps": st.steps,
                         "accepted_drafts": st.accepted_drafts, "context_forwards": st.context_forwards,
                         "wall_s": round(wl, 6)}
                        for w, t, st, wl in zip(where, tokens[name], stats[name], walls[name])],
        }
    exactness = outputs_claim(spec.attention, tokens, {name: reference for name, (reference, _) in methods.items()})
    result = {"schema_version": SCHEMA_VERSION, "methods": summary, "meta": {
        "command": command, "mode": "dllm", "prompts": e.prompts or "tiny test split", "num_prompts": len(prompts),
        "prompts_sha256": prompt_ids_sha256([ids[0].tolist() for ids in prompts]),
        "chat_template_sha256": template_sha256(template),
        "graph": c.graph, "graph_calibrated_on": graph.meta.get("prompts"), "position_order": graph.position_order,
        "block_length": c.block_length,
        "tokens_per_step": c.tokens_per_step, "threshold": c.threshold, "exactness": exactness,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch_threads": torch.get_num_threads(),
        "machine": machine(model.device, model.dtype), "versions": versions(),
    }}
    meta = result["meta"]
    out = mark_folder(e.out, "eval")
    write_result(out / "eval.json", report_json(result))  # kept elsewhere if the disk is full
    example = tokenizer.decode(tokens["vanilla"][0])
    lines = ["| method | NFE reduction | speedup | tokens/s | NFE/token | exact match (vs) | accepted drafts |",
             "|---|---|---|---|---|---|---|"]
    for name, m in summary.items():
        lines.append(f"| {name} | {m['nfe_reduction']:.2f}× | {m['speedup']:.2f}× | {m['tokens_per_s']:.1f} | "
                     f"{m['nfe_per_token']:.3f} | {m['exact_match']:.2f} ({m['exact_against']}) | {m['accepted_drafts']} |")
    report = [f"# align eval (dLLM): {recipe.name}", "", f"`{command}`", "",
              f"{len(prompts)} prompts ({result['meta']['prompts']}); graph calibrated on "
              f"{graph.meta.get('prompts', '?')} ({graph.position_order} order); block {c.block_length}, {c.tokens_per_step} token(s) per step, "
              f"threshold {c.threshold}. NFE reduction and speedup are against vanilla.", "",
              f"{meta['machine']['gpu'] or meta['machine']['cpu_model']}, {meta['machine']['torch_threads']} torch "
              "threads; " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v) + ".", "", *lines, "",
              f"Outputs against vanilla: {exactness}.", "",
              # A weak dLLM can decode into repetition, which makes its future states easy to guess: show what the
              # numbers were measured on.
              f"Vanilla output for the first prompt (repr, first 300 characters): `{example!r:.300}`", ""]
    write_text_atomic(out / "report.md", "\n".join(report))
    print("\n".join(report))
