"""`align eval` with eval.mode=speculative: every decoding method on the same prompts, in one process, interleaved,
after warm-up.

Writes `eval.json`, `report.md` and PNG plots to `eval.out`. Speedups are against the faster of our AR loop and HF
`generate()`: a slow baseline would inflate every number.

What eval.json holds, by `schema_version`, is in docs/evaluation.md ("What `eval.json` holds"), its only
description.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from transformers import AutoConfig

from align.bench import Run, interleaved, report_json
from align.checkpoint import drafter_identity
from align.config import Recipe, RecipeError, first_line
from align.data import (chat_template, encode_prompts, eval_prompt_rows, prompt_ids_sha256, prompt_places,
                        template_sha256)
from align.decoding.generation import GenerationStats, Sampling, mean_accepted_length
from align.decoding.timers import verifier_latency
from align.disk import mark_folder, naming_path, write_result, write_text_atomic
from align.drafters import drafter_for
from align.drafters.loading import load_drafter
from align.drafters.spec import method_refusal
from align.machine import machine, versions
from align.methods import (BASELINES, METHODS, OPAQUE, Setup, base_method, eos_token_ids, ignored_generation_settings,
                           prompt_generator, proxy_source, suffix_index, trigram_proxy)
from align.models import load_ar_drafter, load_tokenizer, load_verifier
from align.preflight import context_length


# --------------------------------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------------------------------
def run_all(setups: dict[str, Setup], prompts: list[torch.Tensor], sampling: Sampling, warmup: int,
            repeats: int, seed: int, desc: str) -> dict[str, Run]:
    """Every method (name -> its setup) on every prompt, interleaved; prompt i samples from its own seed
    (methods.prompt_generator, as the Python API does). What a method learns as it decodes (Setup.learned) carries
    from each prompt to the next, as a server's, and starts afresh after the warm-up and at each call: a measured
    prompt never decodes with what its own warm-up run or an earlier repeat of it taught."""
    started: dict[str, tuple[int, dict]] = {}  # name -> (prompt, what it had learnt before that prompt's first run)

    def run(name: str, i: int, ids: torch.Tensor) -> tuple[list[int], GenerationStats]:
        setup = setups[name]
        if name in started and started[name][0] == i:  # a repeat starts where the prompt's first run started
            setup.learned = copy.deepcopy(started[name][1])
        else:
            started[name] = (i, copy.deepcopy(setup.learned))
        return METHODS[base_method(name)](setup, ids, sampling, prompt_generator(seed, i, ids.device))

    def method(name: str) -> Callable[[int, torch.Tensor], tuple[list[int], GenerationStats]]:
        return lambda i, ids: run(name, i, ids)

    def forget() -> None:
        started.clear()
        for setup in setups.values():
            setup.forget()

    forget()
    return interleaved({name: method(name) for name in setups}, prompts, warmup, repeats, desc, forget)


SCHEMA_VERSION = 4  # of eval.json: what each version holds is in docs/evaluation.md


def exact_match_semantics(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """What `exact_match` says, for eval.json: every method's greedy output compared, all or nothing per prompt, with
    the `ar` method's (one token per verifier forward), in the device and dtype the verifier ran in; and what holds
    there. Acceptance keeps a draft token only where it equals the verifier's argmax, so outputs are identical in exact
    arithmetic. Speculative methods score several positions per forward (trees and self-selection also batch
    candidates), AR one: where kernels are not batch-invariant (bf16/fp16 on GPUs), a position's logits differ in the
    last bits with the forward's shape, and a near-tie can flip an argmax; vLLM documents the same limit
    ("lossless up to the precision limits of hardware numerics")."""
    exact = dtype == torch.float32
    return {
        "compares": "each prompt's new tokens with the ar method's (greedy, one token per verifier forward)",
        "device": device.type, "dtype": str(dtype).removeprefix("torch."),
        "guarantee": ("token-identical to AR greedy (float32 is what align's tests check every method in, token for "
                      "token)"
                      if exact else
                      f"identical to AR greedy up to {str(dtype).removeprefix('torch.')} numerics: a method that "
                      "verifies several tokens (or candidates) per forward can flip an argmax at a near-tie where "
                      "kernels are not batch-invariant; each output is still the verifier's greedy continuation as "
                      "that forward computed it. Run eval in float32 (verifier.dtype=float32) for an exact check"),
    }


def position_counts(accept_counts: list[int], draft_lengths: list[int], max_len: int) -> list[int]:
    """How many drafts reached each draft position i = 1..max_len (all earlier positions accepted): the sample size
    of GenerationStats.per_position_acceptance's α_i."""
    return [sum(1 for n, g in zip(accept_counts, draft_lengths) if n >= i and g > i) for i in range(max_len)]


def prompt_records(run: Run, prompts: list[dict[str, Any]], speculative: bool) -> list[dict[str, Any]]:
    """eval.json's per-prompt records of one method (schema 2); `prompts`: each prompt's index, row, id and
    prompt_tokens."""
    records = []
    for where, tokens, stats, wall in zip(prompts, run.tokens, run.stats, run.wall_s):
        accepted = [n + 1 for n in stats.accept_counts] if speculative else None
        tau = stats.tau
        records.append({**where, "new_tokens": len(tokens), "verifier_forwards": stats.verifier_forwards,
                        "drafter_forwards": stats.drafter_forwards, "tau": round(tau, 4),
                        "accepted_lengths": accepted,
                        "draft_lengths": list(stats.draft_lengths) if speculative else None,
                        "wall_s": round(wall, 6)})
    return records


def summarise(runs: dict[str, Run], setup: Setup, prompts: list[torch.Tensor],
              reference: Optional[list[list[int]]], where: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """eval.json's per-method fields. reference: AR greedy tokens per prompt (None for a sampled run); where: each
    prompt's index, row, id and prompt_tokens, for the per-prompt records."""
    baseline_wall = min(sum(runs[b].wall_s) for b in BASELINES if b in runs)
    context = int(statistics.median(p.shape[1] for p in prompts)) + setup.decode.max_new_tokens // 2
    latency: dict[tuple[int, int], float] = {}

    def verify_cost(tokens: int, batch: int) -> float:
        if (tokens, batch) not in latency:
            latency[tokens, batch] = verifier_latency(setup.verifier, context, tokens, batch)
        return latency[tokens, batch]

    out: dict[str, dict[str, Any]] = {}
    for name, run in runs.items():
        pooled = GenerationStats(
            new_tokens=sum(len(t) for t in run.tokens),
            verifier_forwards=sum(s.verifier_forwards for s in run.stats),
            drafter_forwards=sum(s.drafter_forwards for s in run.stats),
            accept_counts=[n for s in run.stats for n in s.accept_counts],
            draft_lengths=[g for s in run.stats for g in s.draft_lengths],
            tree_nodes=[k for s in run.stats for k in s.tree_nodes],
            draft_s=sum(s.draft_s for s in run.stats), verify_s=sum(s.verify_s for s in run.stats),
        )
        wall = sum(run.wall_s)
        method = base_method(name)
        speculative = method != "ar" and method not in OPAQUE
        tau = mean_accepted_length(run.stats)  # the Python API's stats.tau, pooled over the prompts
        entry: dict[str, Any] = {
            "tau": round(tau, 4),
            "speedup": round(baseline_wall / wall, 4),
            "tokens_per_s": round(pooled.new_tokens / wall, 2),
            "exact_match": None if reference is None else sum(t == r for t, r in zip(run.tokens, reference)) / len(reference),
            "per_position_acceptance": None,
            "verifier_forwards": pooled.verifier_forwards,
            "drafter_forwards": pooled.drafter_forwards,
            "new_tokens": pooled.new_tokens,
            "wall_s": round(wall, 4),
            "ideal_speedup": None,
        }
        if speculative and pooled.accept_counts:
            iterations = len(pooled.accept_counts)
            mean_draft = sum(pooled.draft_lengths) / iterations
            batch = setup.decode.num_candidates if method == "specdiff2_select" else 1
            # A draft tree verifies its nodes, not its depth.
            verified = sum(pooled.tree_nodes) / iterations if pooled.tree_nodes else mean_draft
            ideal = tau * verify_cost(1, 1) / (verify_cost(round(verified) + 1, batch) + pooled.draft_s / iterations)
            longest = max(pooled.draft_lengths)
            entry.update({
                "per_position_acceptance": [None if a is None else round(a, 4)
                                            for a in pooled.per_position_acceptance(longest)],
                "per_position_reached": position_counts(pooled.accept_counts, pooled.draft_lengths, longest),
                "ideal_speedup": round(ideal, 4),
                "overhead": round(1 - entry["speedup"] / ideal, 4),
                "mean_draft_length": round(mean_draft, 3),
                "draft_s": round(pooled.draft_s, 4),
                "verify_s": round(pooled.verify_s, 4),
            })
            if pooled.tree_nodes:
                entry["mean_tree_nodes"] = round(verified, 3)
            if method.endswith(("adl", "cost")):  # sizes chosen per step: the first prompt's, for the trace plot
                entry["draft_length_trace"] = run.stats[0].tree_nodes or run.stats[0].draft_lengths
        entry["records"] = prompt_records(run, where, speculative)
        out[name] = entry
    return out


# --------------------------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------------------------
def _fmt(value: Any, spec: str = ".2f") -> str:
    return "—" if value is None else format(value, spec)


def report_table(methods: dict[str, dict[str, Any]]) -> str:
    lines = ["| method | τ | speedup | ideal | tokens/s | exact match | verifier fwd | drafter fwd |",
             "|---|---|---|---|---|---|---|---|"]
    for name, m in methods.items():
        lines.append(f"| {name} | {_fmt(m['tau'])} | {_fmt(m['speedup'])}× | {_fmt(m['ideal_speedup'])} | "
                     f"{_fmt(m['tokens_per_s'], '.1f')} | {_fmt(m['exact_match'])} | {m['verifier_forwards']} | "
                     f"{m['drafter_forwards']} |")
    return "\n".join(lines)


def before_after_table(methods: dict[str, dict[str, Any]]) -> Optional[str]:
    """Each method next to its runs with eval.compare_drafters (`<method>@<label>`): τ and speedup before and after;
    None without compared drafters."""
    lines = ["| method | drafter | τ | τ ratio | speedup |", "|---|---|---|---|---|"]
    for name, before in methods.items():
        compared = {other.split("@", 1)[1]: m for other, m in methods.items() if other.startswith(name + "@")}
        if compared:
            lines.append(f"| {name} | drafter.path | {_fmt(before['tau'])} | 1.00× | "
                         f"{_fmt(before['speedup'])}× |")
            for label, after in compared.items():
                lines.append(f"| {name} | {label} | {_fmt(after['tau'])} | {after['tau'] / before['tau']:.2f}× | "
                             f"{_fmt(after['speedup'])}× |")
    return "\n".join(lines) if len(lines) > 2 else None


def drafter_groups(result: dict[str, Any]) -> dict[str, Optional[str]]:
    """Which drafter each method ran with, for one colour per drafter: `<method>@<label>` ran eval.compare_drafters'
    `label`; a method with compared twins ran drafter.path (named by its folder); None: a method that runs no compared
    drafter (the baselines, the AR drafter's methods), and every method when no drafters are compared."""
    names = list(result["methods"])
    if not any("@" in n for n in names):
        return {n: None for n in names}
    drafter = result.get("meta", {}).get("drafter")
    own = f"{Path(drafter).name} (drafter.path)" if drafter else "drafter.path"
    return {n: n.split("@", 1)[1] if "@" in n else own if any(o.startswith(n + "@") for o in names) else None
            for n in names}


FEW_DRAFTS = 10  # an α_i measured on fewer drafts is drawn hollow: its value is mostly noise


def write_plots(result: dict[str, Any], out: Path) -> list[str]:
    """PNGs of the greedy run: τ and speedup bars with their values written on them, acceptance curves over the number
    of drafts that reached each position (an α_i from a handful of drafts means little), and ADL's draft lengths.
    With eval.compare_drafters, each drafter has one colour across the plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    methods = result["methods"]
    names = list(methods)
    groups = drafter_groups(result)
    palette = plt.get_cmap("tab10").colors
    drafters = list(dict.fromkeys(g for g in groups.values() if g is not None))
    colour = {None: "tab:gray" if drafters else "tab:blue", **{g: palette[k % 10] for k, g in enumerate(drafters)}}
    legend = ([Patch(color=colour[g], label=g) for g in drafters] +
              ([Patch(color=colour[None], label="no compared drafter")] if None in groups.values() else []))
    written = []

    fig, ax = plt.subplots(figsize=(max(7.0, 0.6 * len(names) + 2), 3.8))
    bars = ax.bar(names, [methods[n]["tau"] for n in names], color=[colour[groups[n]] for n in names])
    ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.set_ylabel("τ (tokens per verifier forward)")
    ax.set_title(f"Mean accepted length, temperature 0, {result.get('meta', {}).get('num_prompts', '?')} prompts")
    plt.setp(ax.get_xticklabels(), rotation=35, ha="right", rotation_mode="anchor")  # each name under its bar
    ax.margins(y=0.12)
    if drafters:  # beside the axes, where no bar is hidden
        ax.legend(handles=legend, fontsize=7, title="drafter", title_fontsize=7, loc="upper left",
                  bbox_to_anchor=(1.01, 1))
    fig.tight_layout(); fig.savefig(out / "tau.png", dpi=110); plt.close(fig); written.append("tau.png")

    fig, ax = plt.subplots(figsize=(max(7.0, 0.6 * len(names) + 2), 3.8))
    x = range(len(names))
    tints = [colour[groups[n]] for n in names]
    measured = ax.bar([i - 0.2 for i in x], [methods[n]["speedup"] for n in names], width=0.4, color=tints)
    ideal = ax.bar([i + 0.2 for i in x], [methods[n]["ideal_speedup"] or 0 for n in names], width=0.4, color=tints,
                   alpha=0.35, hatch="//", edgecolor=tints)
    ax.bar_label(measured, fmt="%.2f", fontsize=6, padding=1)
    ax.bar_label(ideal, labels=[_fmt(methods[n]["ideal_speedup"]) if methods[n]["ideal_speedup"] else ""
                                for n in names], fontsize=6, padding=1)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(list(x), names, rotation=35, ha="right", rotation_mode="anchor")
    ax.set_ylabel("speedup vs fastest AR baseline")
    ax.margins(y=0.12)
    style = [Patch(color="dimgray", label="measured"),
             Patch(facecolor="dimgray", alpha=0.35, hatch="//", edgecolor="dimgray", label="ideal")]
    ax.legend(handles=style + (legend if drafters else []), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout(); fig.savefig(out / "speedup.png", dpi=110); plt.close(fig); written.append("speedup.png")

    curves = {n: m for n, m in methods.items() if m["per_position_acceptance"]}
    if curves:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 5.2), sharex=True, height_ratios=(3, 2))
        dashes = ["-", "--", ":", "-."]
        bases = list(dict.fromkeys(base_method(n) for n in curves))
        for k, (name, m) in enumerate(curves.items()):
            alphas, reached = m["per_position_acceptance"], m.get("per_position_reached") or []
            points = [(i + 1, a) for i, a in enumerate(alphas) if a is not None]
            # With compared drafters: the drafter's colour, a line style per method; else one colour per method.
            tint = colour[groups[name]] if drafters else palette[k % 10]
            line = dashes[bases.index(base_method(name)) % 4] if drafters else "-"
            top.plot([p[0] for p in points], [p[1] for p in points], line, marker="o", ms=3, color=tint, label=name)
            few = [p for p in points if p[0] <= len(reached) and reached[p[0] - 1] < FEW_DRAFTS]
            top.plot([p[0] for p in few], [p[1] for p in few], "o", ms=5, color=tint, markerfacecolor="white")
            bottom.plot(range(1, len(reached) + 1), reached, line, marker=".", ms=3, color=tint)
            # the count on the curve's last point: how few drafts its tail stands on
            if points and reached:
                last = points[-1][0]
                top.annotate(f"n={reached[last - 1]}", points[-1], fontsize=6, color=tint,
                             xytext=(3, 2), textcoords="offset points")
        top.set_ylabel("α_i = P(accept i | accepted < i)"); top.set_ylim(0, 1.08)
        top.set_title(f"Per-position acceptance, temperature 0 (hollow: fewer than {FEW_DRAFTS} drafts reached i)")
        top.legend(fontsize=7, ncol=2)
        if any(any(m.get("per_position_reached") or []) for m in curves.values()):
            bottom.set_yscale("log")  # counts fall geometrically with the position
        bottom.set_xlabel("draft position i"); bottom.set_ylabel("drafts reaching i (n)")
        bottom.grid(True, which="major", alpha=0.3)
        bottom.xaxis.set_major_locator(MaxNLocator(integer=True))  # draft positions are whole numbers
        fig.tight_layout(); fig.savefig(out / "acceptance.png", dpi=110); plt.close(fig)
        written.append("acceptance.png")

    traces = {n: m["draft_length_trace"] for n, m in methods.items() if m.get("draft_length_trace")}
    if traces:
        fig, ax = plt.subplots(figsize=(7, 3))
        for name, trace in traces.items():
            ax.step(range(1, len(trace) + 1), trace, where="post", label=name,
                    color=colour[groups[name]] if drafters else None)
        ax.set_xlabel("iteration (first prompt)"); ax.set_ylabel("draft length (tree: nodes)")
        ax.legend(); fig.tight_layout(); fig.savefig(out / "adl_trace.png", dpi=110); plt.close(fig)
        written.append("adl_trace.png")
    return written


def write_report(result: dict[str, Any], recipe: Recipe, command: str, out: Path) -> str:
    """out/report.md (tables and plots) from eval.json's content; returns its text."""
    d, meta = recipe.decode, result["meta"]
    plots = write_plots(result, out)
    report = [f"# align eval: {recipe.name}", "", f"`{command}`", "",
              f"{meta['num_prompts']} prompts ({meta['prompts']}), {d.max_new_tokens} new tokens, γ={d.gamma}; "
              f"{meta['machine']['gpu'] or meta['machine']['cpu_model']}, {meta['machine']['cpus']} CPUs, "
              f"{meta['machine']['torch_threads']} torch threads, {meta['machine']['dtype']}; "
              f"speedup vs the {meta['baseline']}.", "",
              "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v) + ".", "",
              "## Temperature 0", "", report_table(result["methods"]), ""]
    comparison = before_after_table(result["methods"])
    if comparison:
        report += ["## Compared drafters (eval.compare_drafters), temperature 0", "", comparison, ""]
    if "sampling" in result:
        report += [f"## Temperature {result['sampling']['temperature']}", "",
                   report_table(result["sampling"]["methods"]), ""]
    report += [f"![{p}]({p})" for p in plots]
    text = "\n".join(report) + "\n"
    write_text_atomic(out / "report.md", text)
    return text


# --------------------------------------------------------------------------------------------------------------------
# the stage
# --------------------------------------------------------------------------------------------------------------------
def evaluate(recipe: Recipe, command: str, needed: tuple[str, ...]) -> int:
    """Run the methods on the prompts; `needed`: the model keys the stage loads (align.stages.evaluate.models)."""
    d, e = recipe.decode, recipe.eval
    names = list(dict.fromkeys([*BASELINES, *e.methods]))  # both baselines always run: speedup needs the faster
    # The models loaded here are those cli checked before the stage (preflight.check_models: paths, weights files,
    # drafter specs, one vocabulary).
    uses_drafter, uses_ar_drafter = "drafter.path" in needed, "ar_drafter.path" in needed
    tokenizer = load_tokenizer(recipe.verifier.path, recipe.verifier.trust_remote_code)
    template = chat_template(tokenizer, recipe.data.chat_template, recipe.verifier.path)
    rows = eval_prompt_rows(recipe)
    texts = [r.prompt for r in rows]
    compared = {label: recipe.drafter.model_copy(update={"path": path})
                for label, path in (e.compare_drafters.items() if uses_drafter else ())}
    # The verifier's config first: a too-long prompt is refused before any weights are loaded.
    context = AutoConfig.from_pretrained(recipe.verifier.path, trust_remote_code=recipe.verifier.trust_remote_code)
    prompts = encode_prompts(tokenizer, texts, template, d.max_new_tokens, context_length(context))
    where = prompt_places(rows, prompts)
    source = proxy_source(recipe) if any("cps" in n for n in names) else None
    verifier = load_verifier(recipe.verifier)
    prompts = [ids.to(verifier.device) for ids in prompts]  # the tokenizer gives CPU tensors
    drafter, spec = load_drafter(recipe.drafter, tokenizer) if uses_drafter else (None, None)
    ar_drafter = load_ar_drafter(recipe.ar_drafter) if uses_ar_drafter else None
    eos_ids = eos_token_ids(verifier, tokenizer)  # generation_config's end tokens too, as the Python API stops
    proxy = trigram_proxy(source, recipe.data.dir, tokenizer) if source is not None else None
    setup = Setup(verifier, drafter, spec, ar_drafter, tokenizer, eos_ids, d, proxy, d.verify_costs_s, d.draft_cost_s)
    if any("suffix" in base_method(n) for n in names):
        setup.suffix = suffix_index(recipe)
    if any(base_method(n).endswith("_cost") for n in names):  # one cost curve for every drafter compared
        setup.measured_costs(prompts[len(prompts) // 2])
    setups = {name: replace(setup, learned={}) for name in names}  # each learns apart (Setup.learned)
    refusals = [f"{name} {why}" for name in names
                if spec is not None and (why := method_refusal(spec.kind, name, "drafter.path"))]
    if refusals:
        raise RecipeError(f"eval.methods: {refusals[0]}")
    for label, section in compared.items():
        other, other_spec = load_drafter(section, tokenizer)
        for name in names:
            if name.startswith("specdiff") and name not in drafter_for(other, other_spec).refused_methods:
                setups[f"{name}@{label}"] = replace(setup, drafter=other, spec=other_spec, learned={})
    names = list(setups)
    out = mark_folder(e.out, "eval")

    print(f"eval: {len(prompts)} prompts, {d.max_new_tokens} new tokens, γ={d.gamma}, methods: {', '.join(names)}")
    greedy = run_all(setups, prompts, Sampling(), e.warmup, e.repeats, d.seed, "temperature 0")
    result: dict[str, Any] = {"schema_version": SCHEMA_VERSION,
                              "methods": summarise(greedy, setup, prompts, greedy["ar"].tokens, where)}
    failed = None
    if e.sampling_temperature > 0:
        sampling = Sampling(e.sampling_temperature, d.top_k, d.top_p)
        try:
            sampled = run_all(setups, prompts, sampling, e.warmup, e.repeats, d.seed,
                              f"temperature {sampling.temperature}")
        except RuntimeError as error:  # e.g. non-finite probabilities (a NaN drafter): the greedy run is not lost
            failed = f"the temperature {sampling.temperature} run stopped ({first_line(error)})"
        else:
            result["sampling"] = {"temperature": sampling.temperature,
                                  "methods": summarise(sampled, setup, prompts, None, where)}
    result["meta"] = {
        "command": command, "recipe": recipe.to_dict(), "prompts": e.prompts or "tiny test split",
        "num_prompts": len(prompts), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        # the token ids every method read, and the chat template that rendered them
        "prompts_sha256": prompt_ids_sha256([ids[0].tolist() for ids in prompts]),
        "chat_template_sha256": template_sha256(template),
        "machine": machine(next(verifier.parameters()).device, verifier.dtype),
        "versions": versions(),
        "baseline": "fastest of " + " and ".join(BASELINES),
        "drafter_spec": spec.to_dict() if spec else None,
        "drafter": recipe.drafter.path if uses_drafter else None,
        "compare_drafters": {label: section.path for label, section in compared.items()},
        # resolved paths and weight hashes: the rows are found again from any folder (align export)
        "drafters": ([{"rows": "", **drafter_identity(recipe.drafter.path)}] if uses_drafter else []) +
                    [{"rows": f"@{label}", **drafter_identity(section.path)} for label, section in compared.items()],
        "exact_match_semantics": exact_match_semantics(next(verifier.parameters()).device, verifier.dtype),
        # the verifier's generation_config.json settings no method applied (the HF baselines are handed none of
        # them): every row decodes the same target, plain greedy or the recipe's temperature/top-k/top-p
        "generation_config_ignored": ignored_generation_settings(verifier),
        # the cost-aware methods' measured curve: seconds of a verifier forward over n = 1.. new tokens
        "verify_costs_s": None if setup.verify_costs is None else [round(t, 6) for t in setup.verify_costs],
    }
    write_result(out / "eval.json", report_json(result))  # kept elsewhere if the disk is full: hours of work
    with naming_path(out):  # matplotlib's write names no file
        report = write_report(result, recipe, command, out)
    print(report.split("\n![")[0])
    print(f"wrote {out / 'eval.json'}, {out / 'report.md'} and its plots")
    if failed is not None:
        print(f"align eval: error: {failed}; eval.json holds the greedy run", file=sys.stderr)
        return 1
    return 0
