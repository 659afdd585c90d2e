"""`align eval`: every decoding method on the same prompts, in one process, interleaved, after warm-up.

Writes `eval.json` (per method: τ, speedup, tokens/s, exact match with AR greedy, per-position acceptance, forwards,
wall time, ideal speedup), `report.md` and PNG plots to `eval.out`. The greedy run is under `methods`, the sampled
run under `sampling.methods`. Speedups are against the faster of our AR loop and HF `generate()`: a slow baseline
would inflate every number.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from transformers import AutoConfig

from align.bench import Run, interleaved, verifier_latency
from align.checkpoint import atomic_folder, write_text_atomic
from align.config import Recipe, RecipeError, eval_models
from align.corpus import ensure_data
from align.data import (chat_template, encode_prompts, eval_prompts, load_trajectories, prompt_ids_sha256,
                        template_sha256)
from align.decoding.cps import TrigramModel
from align.decoding.generation import GenerationStats, Sampling
from align.methods import BASELINES, DFLASH_METHODS, METHODS, OPAQUE, Setup, base_method
from align.models import context_length, load_ar_drafter, load_drafter, load_tokenizer, load_verifier


# --------------------------------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------------------------------
def proxy_source(recipe: Recipe) -> Path:
    """What the CPS proxy is fitted on: decode.cps_proxy_corpus, a JSONL text corpus (`text` field) or a trajectories
    folder, or by default the tiny corpus's train split. Checked before any model is loaded."""
    source = Path(recipe.decode.cps_proxy_corpus or
                  ensure_data(recipe.data.dir, recipe.bootstrap.corpus_fraction) / "corpus" / "train.jsonl")
    if not (source.is_file() or (source / "manifest.json").is_file()):
        raise RecipeError(f"decode.cps_proxy_corpus: {source} is neither a JSONL file nor a trajectories folder")
    return source


def trigram_proxy(source: Path, data_dir: str, tokenizer: Any) -> TrigramModel:
    """The CPS causal proxy, fitted once on `source` (from proxy_source) with the verifier's tokenizer and cached under
    data_dir/trigram/.

    Fitted on a trajectories folder, it models the verifier's own continuations rather than the corpus: the right
    proxy for a drafter aligned to that verifier, whose drafts a corpus n-gram would pull back toward the corpus.
    """
    import hashlib

    import numpy as np

    stamp = (json.loads((source / "manifest.json").read_text())["settings_hash"] if source.is_dir()
             else os.path.getsize(source))
    key = f"{source.resolve()}:{stamp}:{len(tokenizer)}:{tokenizer.name_or_path}"
    folder = Path(data_dir) / "trigram" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if (folder / "manifest.json").is_file():
        return TrigramModel.load(folder)
    eos = tokenizer.eos_token_id
    if source.is_dir():
        rows = load_trajectories(source)
        docs = [p + c for p, c in zip(rows["prompt_ids"], rows["completion_ids"])]
    else:
        from datasets import load_dataset

        docs = tokenizer(list(load_dataset("json", data_files=str(source), split="train")["text"]),
                         add_special_tokens=False)["input_ids"]
    stream = np.fromiter((t for doc in docs for t in (doc if doc and doc[-1] == eos else [*doc, eos])), dtype=np.int64)
    model = TrigramModel.fit(stream, len(tokenizer))
    with atomic_folder(folder) as tmp:
        model.save(tmp, source=str(source))
    return model


# --------------------------------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------------------------------
def run_all(setups: dict[str, Setup], prompts: list[torch.Tensor], sampling: Sampling, warmup: int,
            repeats: int, seed: int, desc: str) -> dict[str, Run]:
    """Every method (name -> its setup) on every prompt, interleaved; prompt i samples from its own seed, with a
    generator on the prompt's device (a CPU generator cannot drive sampling on a GPU)."""
    def generator(i: int, device: torch.device) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(seed * 100_003 + i)

    def method(name: str) -> Callable[[int, torch.Tensor], tuple[list[int], GenerationStats]]:
        return lambda i, ids: METHODS[base_method(name)](setups[name], ids, sampling, generator(i, ids.device))

    return interleaved({name: method(name) for name in setups}, prompts, warmup, repeats, desc)


def summarise(runs: dict[str, Run], setup: Setup, prompts: list[torch.Tensor],
              reference: Optional[list[list[int]]]) -> dict[str, dict[str, Any]]:
    """eval.json's per-method fields. reference: AR greedy tokens per prompt (None for a sampled run)."""
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
        if speculative:
            tau = pooled.tau
        else:  # tokens after the first (which the prefill gives) per decoding verifier forward
            tau = (pooled.new_tokens - len(run.tokens)) / max(pooled.verifier_forwards, 1)
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
            entry.update({
                "per_position_acceptance": [None if a is None else round(a, 4)
                                            for a in pooled.per_position_acceptance(max(pooled.draft_lengths))],
                "ideal_speedup": round(ideal, 4),
                "overhead": round(1 - entry["speedup"] / ideal, 4),
                "mean_draft_length": round(mean_draft, 3),
                "draft_s": round(pooled.draft_s, 4),
                "verify_s": round(pooled.verify_s, 4),
            })
            if pooled.tree_nodes:
                entry["mean_tree_nodes"] = round(verified, 3)
            if method.endswith("adl"):
                entry["draft_length_trace"] = run.stats[0].draft_lengths
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


def write_plots(result: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = result["methods"]
    names = list(methods)
    written = []
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.bar(names, [methods[n]["tau"] for n in names], color="tab:blue")
    ax.set_ylabel("τ (tokens per verifier forward)")
    ax.set_title("Mean accepted length, temperature 0")
    ax.tick_params(axis="x", rotation=35)
    fig.tight_layout(); fig.savefig(out / "tau.png", dpi=110); plt.close(fig); written.append("tau.png")

    fig, ax = plt.subplots(figsize=(9, 3.5))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [methods[n]["speedup"] for n in names], width=0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [methods[n]["ideal_speedup"] or 0 for n in names], width=0.4, label="ideal")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(list(x), names, rotation=35)
    ax.set_ylabel("speedup vs fastest AR baseline")
    ax.legend(); fig.tight_layout(); fig.savefig(out / "speedup.png", dpi=110); plt.close(fig); written.append("speedup.png")

    curves = {n: m["per_position_acceptance"] for n, m in methods.items() if m["per_position_acceptance"]}
    if curves:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for name, alphas in curves.items():
            points = [(i + 1, a) for i, a in enumerate(alphas) if a is not None]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, label=name)
        ax.set_xlabel("draft position i"); ax.set_ylabel("α_i = P(accept i | accepted < i)"); ax.set_ylim(0, 1.05)
        ax.legend(fontsize=7); fig.tight_layout(); fig.savefig(out / "acceptance.png", dpi=110); plt.close(fig)
        written.append("acceptance.png")

    traces = {n: m["draft_length_trace"] for n, m in methods.items() if m.get("draft_length_trace")}
    if traces:
        fig, ax = plt.subplots(figsize=(7, 3))
        for name, trace in traces.items():
            ax.step(range(1, len(trace) + 1), trace, where="post", label=name)
        ax.set_xlabel("iteration (first prompt)"); ax.set_ylabel("draft length")
        ax.legend(); fig.tight_layout(); fig.savefig(out / "adl_trace.png", dpi=110); plt.close(fig)
        written.append("adl_trace.png")
    return written


def write_report(result: dict[str, Any], recipe: Recipe, command: str, out: Path) -> str:
    """out/report.md (tables and plots) from eval.json's content; returns its text."""
    d, meta = recipe.decode, result["meta"]
    plots = write_plots(result, out)
    report = [f"# align eval: {recipe.name}", "", f"`{command}`", "",
              f"{meta['num_prompts']} prompts ({meta['prompts']}), {d.max_new_tokens} new tokens, γ={d.gamma}; "
              f"{meta['machine']['processor']}, {meta['machine']['cpus']} CPUs, {meta['machine']['dtype']}; "
              f"speedup vs the {meta['baseline']}.", "",
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
def main(recipe: Recipe, command: str) -> None:
    d, e = recipe.decode, recipe.eval
    names = list(dict.fromkeys([*BASELINES, *e.methods]))  # both baselines always run: speedup needs the faster
    # The models loaded here are those cli checked before the stage (config.check_models: paths, weights files,
    # drafter specs, one vocabulary).
    needed = eval_models(recipe)
    uses_drafter, uses_ar_drafter = "drafter.path" in needed, "ar_drafter.path" in needed
    tokenizer = load_tokenizer(recipe.verifier.path, recipe.verifier.trust_remote_code)
    template = chat_template(tokenizer, recipe.data.chat_template, recipe.verifier.path)
    texts = eval_prompts(recipe)
    compared = {label: recipe.drafter.model_copy(update={"path": path})
                for label, path in (e.compare_drafters.items() if uses_drafter else ())}
    # The verifier's config first: a too-long prompt is refused before any weights are loaded.
    context = AutoConfig.from_pretrained(recipe.verifier.path, trust_remote_code=recipe.verifier.trust_remote_code)
    prompts = encode_prompts(tokenizer, texts, template, d.max_new_tokens, context_length(context))
    source = proxy_source(recipe) if any("cps" in n for n in names) else None
    verifier = load_verifier(recipe.verifier)
    prompts = [ids.to(verifier.device) for ids in prompts]  # the tokenizer gives CPU tensors
    drafter, spec = load_drafter(recipe.drafter, tokenizer) if uses_drafter else (None, None)
    ar_drafter = load_ar_drafter(recipe.ar_drafter) if uses_ar_drafter else None
    eos_ids = frozenset() if tokenizer.eos_token_id is None else frozenset({tokenizer.eos_token_id})
    proxy = trigram_proxy(source, recipe.data.dir, tokenizer) if source is not None else None
    setup = Setup(verifier, drafter, spec, ar_drafter, tokenizer, eos_ids, d, proxy)
    setups = {name: setup for name in names}
    if spec is not None and spec.kind == "dflash" and "specdiff2_select" in names:
        raise RecipeError("eval.methods: specdiff2_select does not run a DFlash drafter (drafter.path); "
                          f"its methods are {', '.join(DFLASH_METHODS)}")
    for label, section in compared.items():
        other, other_spec = load_drafter(section, tokenizer)
        for name in names:
            if name.startswith("specdiff") and (other_spec.kind != "dflash" or name in DFLASH_METHODS):
                setups[f"{name}@{label}"] = replace(setup, drafter=other, spec=other_spec)
    names = list(setups)
    out = Path(e.out)
    out.mkdir(parents=True, exist_ok=True)

    print(f"eval: {len(prompts)} prompts, {d.max_new_tokens} new tokens, γ={d.gamma}, methods: {', '.join(names)}")
    greedy = run_all(setups, prompts, Sampling(), e.warmup, e.repeats, d.seed, "temperature 0")
    result: dict[str, Any] = {"methods": summarise(greedy, setup, prompts, greedy["ar"].tokens)}
    if e.sampling_temperature > 0:
        sampling = Sampling(e.sampling_temperature, d.top_k, d.top_p)
        sampled = run_all(setups, prompts, sampling, e.warmup, e.repeats, d.seed, f"temperature {sampling.temperature}")
        result["sampling"] = {"temperature": sampling.temperature, "methods": summarise(sampled, setup, prompts, None)}
    result["meta"] = {
        "command": command, "recipe": recipe.to_dict(), "prompts": e.prompts or "tiny test split",
        "num_prompts": len(prompts), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        # the token ids every method read, and the chat template that rendered them
        "prompts_sha256": prompt_ids_sha256([ids[0].tolist() for ids in prompts]),
        "chat_template_sha256": template_sha256(template),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "device": str(next(verifier.parameters()).device), "dtype": str(verifier.dtype)},
        "baseline": "fastest of " + " and ".join(BASELINES),
        "drafter_spec": spec.to_dict() if spec else None,
        "drafter": recipe.drafter.path if uses_drafter else None,
        "compare_drafters": {label: section.path for label, section in compared.items()},
    }
    write_text_atomic(out / "eval.json", json.dumps(result, indent=2))
    report = write_report(result, recipe, command, out)
    print(report.split("\n![")[0])
    print(f"wrote {out / 'eval.json'}, {out / 'report.md'} and its plots")
