"""`align eval`: decoding methods compared on the same prompts, in one process, interleaved, after warm-up; by
eval.mode, speculative decoding methods against the verifier's AR decoding (speculative.py), or the drafter decoded
alone as a diffusion LM (dllm.py). Writes `eval.json`, `report.md` and plots to `eval.out`.
"""

from __future__ import annotations

from pathlib import Path

from align.config import Recipe, RecipeError
from align.decoding.options import METHOD_MODELS
from align.draft_graph import DraftGraph, check_graph_drafter
from align.drafters.spec import method_refusal
from align.methods import check_suffix_corpus
from align.preflight import check_decodes_alone, check_new_tokens, check_tiny_default, drafter_kind
from align.stages.evaluate import dllm, speculative


def models(recipe: Recipe) -> tuple[str, ...]:
    """The models `align eval` loads: the drafter alone in dllm mode; else the verifier and what the methods need,
    with eval.compare_drafters when a drafter is used."""
    if recipe.eval.mode == "dllm":
        return ("drafter.path",)
    keys = ["verifier.path", *(key for name in recipe.eval.methods for key in METHOD_MODELS.get(name, ()))]
    if "drafter.path" in keys:
        keys += [f"eval.compare_drafters.{label}" for label in recipe.eval.compare_drafters]
    return tuple(dict.fromkeys(keys))


def prompts(recipe: Recipe) -> tuple[tuple[str, str], ...]:
    # in dllm mode the drafter decodes alone, with its own tokenizer
    return (("eval.prompts", "drafter.path" if recipe.eval.mode == "dllm" else "verifier.path"),)


def check(recipe: Recipe) -> None:
    """`align eval`'s checks beyond its models', from configs and the files named: the drafter can run the methods,
    the draft graph is one (dllm mode decodes with it, at the recipe's block length and tokens per step), and the new
    tokens leave room for a prompt in the models' context."""
    e, c, needed = recipe.eval, recipe.calibrate, models(recipe)
    check_new_tokens(recipe, "decode.max_new_tokens", needed)
    if e.mode == "speculative" and any("cps" in name for name in e.methods):
        check_tiny_default(recipe, "decode.cps_proxy_corpus", "verifier.path")
    if e.mode == "speculative" and any("suffix" in name for name in e.methods):
        check_suffix_corpus(recipe)
    if e.mode == "speculative" and "drafter.path" in needed:
        kind = drafter_kind(recipe)
        refusals = [f"{m} {why}" for m in e.methods if (why := method_refusal(kind, m, recipe.drafter.path))]
        if refusals:
            raise RecipeError(f"eval.methods: {refusals[0]}")
    if e.mode == "dllm":
        check_decodes_alone(recipe, "eval.mode=dllm")
        if c.graph is None:
            raise RecipeError("calibrate.graph: eval.mode=dllm needs a draft_graph.json (make one with align "
                              "calibrate)")
        graph = DraftGraph.load(Path(c.graph), block_length=c.block_length, tokens_per_step=c.tokens_per_step)
        check_graph_drafter(graph, c.graph, recipe.drafter.path)
        for budget in e.spiffy_budgets:
            graph.prefix(budget)


def main(recipe: Recipe, command: str) -> int:
    if recipe.eval.mode == "dllm":
        dllm.evaluate(recipe, command)
        return 0
    return speculative.evaluate(recipe, command, models(recipe))
