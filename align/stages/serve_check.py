"""`align serve-check`: does the drafter align trained do in vLLM what it does in align? (issue #13, item 3)

The verifier decodes the eval prompts greedily at batch 1 in three engines: vLLM without a drafter, vLLM with the
DFlash drafter as its `speculative_config` (the speculators folder `align export ... export.format=speculators`
writes; an align DFlash checkpoint is exported to a temporary folder first; with serve_check.ngram, a third vLLM
engine with its n-gram speculator), and align's own runtime (AR greedy and
specdiff with the same drafter, γ = decode.gamma in both engines). Writes `serve_check.json` and `report.md` to
`serve_check.out`. Exit 3, with one line, when the outputs differ or vLLM's mean acceptance length is more than
`serve_check.max_acceptance_gap` (10%) off align's τ: both engines run the same greedy acceptance on the same
weights, so a larger gap is a bug in one of the two. Outputs must be identical in float32 only: in bf16 a forward
over a draft rounds otherwise than one over a token, and vLLM's kernels otherwise than transformers', so outputs that
differ there are reported, not failed (align's token-for-token checks run in float32).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm.auto import tqdm

from align.config import Recipe, RecipeError
from align.data import chat_template, encode_prompts, eval_prompts, prompt_ids_sha256
from align.decoding.ar import ar_generate
from align.decoding.generation import Sampling
from align.decoding.specdiff import specdiff_generate
from align.disk import mark_folder, write_result, write_text_atomic
from align.drafters import ConditionedDrafter, drafter_for
from align.drafters.speculators_format import load_speculators_dflash, write_speculators_folder
from align.drafters.loading import load_drafter
from align.drafters.spec import drafter_spec_from_config
from align.machine import cpu_model
from align.methods import eos_token_ids
from align.models import load_tokenizer, load_verifier
from align.preflight import check_new_tokens, model_context
from align.vllm_engine import ServeResult, serve, served_drafter_kind, vllm_dtype

EXIT_MISMATCH = 3  # the check ran and failed: outputs differ, or acceptance is off by more than allowed
# vLLM's n-gram speculator (serve_check.ngram): drafts follow the longest match of 4 down to 1 tokens in the request.
NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4}


def relative_gap(served: float, reference: float) -> float:
    return abs(served - reference) / reference


def report(result: dict[str, Any]) -> str:
    a, p, s, c = result["align"], result["vllm_plain"], result["vllm_drafter"], result["check"]
    rows = [
        "| engine | outputs identical to align AR greedy | mean acceptance length | tokens/s |",
        "|---|---|---|---|",
        f"| align AR greedy | (reference) | 1.00 | {a['ar_tokens_per_second']:.1f} |",
        f"| align specdiff + drafter | {a['specdiff_identical']} | {a['tau']:.2f} (τ) | "
        f"{a['specdiff_tokens_per_second']:.1f} |",
        f"| vLLM {result['meta']['vllm']} | {p['identical']} | 1.00 | {p['tokens_per_second']:.1f} |",
        f"| vLLM {result['meta']['vllm']} + drafter | {s['identical']} | {s['mean_acceptance_length']:.2f} | "
        f"{s['tokens_per_second']:.1f} |",
    ]
    n = result.get("vllm_ngram")
    if n is not None:
        rows.append(f"| vLLM {result['meta']['vllm']} + n-gram | {n['identical']} | "
                    f"{n['mean_acceptance_length']:.2f} | {n['tokens_per_second']:.1f} |")
    m = result["meta"]
    levels = ["| requests in flight | vLLM tokens/s | vLLM + drafter tokens/s | speedup | mean acceptance length | "
              "outputs identical (without / with) |" + (" n-gram tokens/s | n-gram speedup |" if n else ""),
              "|---|---|---|---|---|---|" + ("---|---|" if n else "")]
    levels += [f"| {r['concurrency']} | {r['plain_tokens_per_second']:.1f} | {r['drafter_tokens_per_second']:.1f} | "
               f"{r['speedup']:.2f}× | {r['mean_acceptance_length']:.2f} | {r['plain_identical']} / "
               f"{r['drafter_identical']} |" + (f" {r['ngram_tokens_per_second']:.1f} | {r['ngram_speedup']:.2f}× |"
                                                if n else "") for r in result.get("concurrency", [])]
    lines = [f"# Serving check: {m['drafter']}", "",
             f"{m['num_prompts']} prompts, greedy, {m['max_new_tokens']} new tokens, γ={m['gamma']}, batch 1, "
             f"{m['dtype']}, {m['machine']}, {m['date']}.", "", *rows, "",
             f"vLLM mean acceptance length / align τ = {c['acceptance_ratio']:.3f} (allowed gap "
             f"{c['max_acceptance_gap']:.0%}); vLLM speedup from the drafter {c['vllm_speedup']:.2f}×.", "",
             f"**{'PASS' if c['passed'] else 'FAIL'}**" + ("" if c["passed"] else f": {c['reason']}")
             + (f" ({c['note']})" if c.get("note") else ""), "",
             "By concurrency (the prompts in groups sent together, vLLM batching them):", "", *levels, ""]
    return "\n".join(lines)


def served_on() -> str:
    """The machine in the report's words: the GPU vLLM serves on, if any, and the CPU by name (platform.processor()
    says only "x86_64" on Linux)."""
    cpu = f"{cpu_model()}, {torch.get_num_threads()} torch threads"
    return f"{torch.cuda.get_device_name()}; {cpu}" if torch.cuda.is_available() else cpu


def identity_problems(identical: dict[str, bool], dtype: str) -> tuple[list[str], Optional[str]]:
    """(failures, note) for the engines whose outputs differ from align's AR greedy (engine name -> identical).

    In float32 a difference is a failure: greedy decoding with a lossless drafter is the verifier's own output. In a
    lower precision it is not evidence of loss: a verification forward over k tokens rounds otherwise than a one-token
    AR step, and another engine's kernels otherwise again, and one flipped near-tie changes the rest of the output (on
    SmolLM2 in bf16, vLLM without any drafter differed from transformers' AR greedy on 12 of 16 prompts). There the
    differences are noted and only the acceptance check can fail."""
    differ = [name for name, same in identical.items() if not same]
    if not differ:
        return [], None
    if dtype == "float32":
        return [f"{name} output differs from align AR greedy" for name in differ], None
    return [], (f"outputs of {', '.join(differ)} differ from align AR greedy: not required identical in {dtype}, "
                "where forwards of other shapes and engines round differently (the token-for-token check is float32)")


def exported_speculative_tokens(folder: Path) -> Optional[int]:
    """The draft tokens a speculators folder says to serve (its first proposal method's), if it says."""
    spec = json.loads((folder / "config.json").read_text()).get("speculators_config")
    methods = spec.get("proposal_methods") if isinstance(spec, dict) else None
    first = methods[0] if isinstance(methods, list) and methods else None
    tokens = first.get("speculative_tokens") if isinstance(first, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None


def served(result: ServeResult, reference: list[list[int]]) -> dict[str, Any]:
    differ = [i for i, (got, want) in enumerate(zip(result.outputs, reference)) if got != want]
    return {"identical": not differ, "differing_prompts": differ, "tokens_per_second": result.tokens_per_second,
            "seconds": result.seconds, "mean_acceptance_length": result.mean_acceptance_length,
            "num_drafts": result.num_drafts, "num_draft_tokens": result.num_draft_tokens,
            "num_accepted_tokens": result.num_accepted_tokens, "accepted_per_position": result.accepted_per_position}


def by_concurrency(plain: ServeResult, drafted: ServeResult, reference: list[list[int]],
                   ngram: Optional[ServeResult] = None) -> dict[str, Any]:
    """vLLM without and with the drafter (and with its n-gram speculator, if served) at one concurrency. Outputs at
    concurrency > 1 are recorded, not required identical: vLLM's batched kernels need not give a batch-1 run's floats
    (its batch invariance is opt-in)."""
    level = {"concurrency": plain.concurrency, "plain_tokens_per_second": plain.tokens_per_second,
             "drafter_tokens_per_second": drafted.tokens_per_second,
             "speedup": drafted.tokens_per_second / plain.tokens_per_second,
             "mean_acceptance_length": drafted.mean_acceptance_length,
             "accepted_per_position": drafted.accepted_per_position,
             "plain_identical": plain.outputs == reference, "drafter_identical": drafted.outputs == reference}
    if ngram is not None:
        level.update(ngram_tokens_per_second=ngram.tokens_per_second,
                     ngram_speedup=ngram.tokens_per_second / plain.tokens_per_second,
                     ngram_mean_acceptance_length=ngram.mean_acceptance_length,
                     ngram_identical=ngram.outputs == reference)
    return level


def models(recipe: Recipe) -> tuple[str, ...]:
    return ("verifier.path",)


def prompts(recipe: Recipe) -> tuple[tuple[str, str], ...]:
    return (("eval.prompts", "verifier.path"),)


def check(recipe: Recipe) -> None:
    """vLLM's environment, serve_check.drafter and decode.gamma (served_drafter_kind), and room for the new tokens."""
    check_new_tokens(recipe, "decode.max_new_tokens", ("verifier.path",))
    served_drafter_kind(recipe)


def main(recipe: Recipe, command: str) -> Optional[int]:
    kind = served_drafter_kind(recipe)  # cli checked it before the stage; the kind says how to load it
    s, d = recipe.serve_check, recipe.decode
    tokenizer = load_tokenizer(recipe.verifier.path, recipe.verifier.trust_remote_code)
    template = chat_template(tokenizer, recipe.data.chat_template, recipe.verifier.path)
    # The verifier's config bounds the prompts: a too-long one is refused before any weights load.
    prompts = encode_prompts(tokenizer, eval_prompts(recipe), template, d.max_new_tokens,
                             model_context(recipe, ("verifier.path",))[0])
    verifier = load_verifier(recipe.verifier)
    eos_ids = eos_token_ids(verifier, tokenizer)
    with tempfile.TemporaryDirectory(prefix="align-serve-check-") as tmp:
        if kind == "align":
            drafter, spec = load_drafter(recipe.drafter.model_copy(update={"path": s.drafter}), tokenizer)
            # served_folder_format read model_type; the spec is what the runtime goes by (`drafter_for` reads it)
            if not isinstance(drafter_for(drafter, spec), ConditionedDrafter):
                raise RecipeError(f"serve_check.drafter: {s.drafter} is not a DFlash drafter ({spec.kind})")
            folder = Path(tmp)
            write_speculators_folder(drafter, verifier, recipe.verifier.path, tokenizer, folder)
        else:
            folder = Path(s.drafter)
            drafter = load_speculators_dflash(str(folder), verifier.device).to(verifier.dtype)
            spec = drafter_spec_from_config(drafter.config)
        prompts = [ids.to(verifier.device) for ids in prompts]
        print(f"serve-check: {len(prompts)} prompts, {d.max_new_tokens} new tokens, γ={d.gamma}, drafter {s.drafter}")
        exported = exported_speculative_tokens(folder) if kind != "align" else None
        if exported is not None and exported != d.gamma:
            print(f"serve-check: serving γ={d.gamma} (decode.gamma); `vllm serve` of this folder serves its own "
                  f"{exported} (export.num_speculative_tokens)")

        # align's runtime: AR greedy (the reference) and specdiff with the drafter, one warm-up prompt first.
        ar_generate(verifier, prompts[0], min(d.max_new_tokens, 8), Sampling(), eos_ids=eos_ids)
        specdiff_generate(verifier, drafter, spec, prompts[0], d.gamma, min(d.max_new_tokens, 8), Sampling(),
                          eos_ids=eos_ids)
        reference, ar_seconds, spec_outputs, spec_seconds, accepted, steps = [], 0.0, [], 0.0, 0, 0
        for ids in tqdm(prompts, desc="align runtime (AR, specdiff)", unit="prompt", dynamic_ncols=True):
            start = time.perf_counter()
            tokens, _ = ar_generate(verifier, ids, d.max_new_tokens, Sampling(), eos_ids=eos_ids)
            ar_seconds += time.perf_counter() - start
            reference.append(list(tokens))
            start = time.perf_counter()
            tokens, stats = specdiff_generate(verifier, drafter, spec, ids, d.gamma, d.max_new_tokens, Sampling(),
                                              eos_ids=eos_ids)
            spec_seconds += time.perf_counter() - start
            spec_outputs.append(list(tokens))
            accepted += sum(n + 1 for n in stats.accept_counts)
            steps += len(stats.accept_counts)
        tau = accepted / steps if steps else 1.0  # pooled over prompts, as vLLM's counters are
        num_tokens = sum(map(len, reference))

        # vLLM: the same token ids, without and with the drafter (two engines: a drafter is fixed at start-up).
        prompt_ids = [ids[0].tolist() for ids in prompts]
        kv_cache_gib = s.vllm_cpu_kv_cache_gib or recipe.trajectories.vllm_cpu_kv_cache_gib
        common = dict(max_new_tokens=d.max_new_tokens, dtype=vllm_dtype(verifier.dtype), kv_cache_gib=kv_cache_gib,
                      stop_token_ids=sorted(eos_ids), concurrency=sorted({1, *s.concurrency}), key="serve_check")
        plain_levels = serve(recipe.verifier.path, prompt_ids, **common)
        # "method" said outright: without it vLLM 0.32 guesses the method from the folder's path and serves any
        # folder not named *dflash* as a standalone draft model (lossless still, but it accepts far less).
        drafted_levels = serve(recipe.verifier.path, prompt_ids, speculative_config={
            "method": "dflash", "model": str(folder.resolve()), "num_speculative_tokens": d.gamma}, **common)
        ngram_levels = serve(recipe.verifier.path, prompt_ids, speculative_config=NGRAM | {
            "num_speculative_tokens": d.gamma}, **common) if s.ngram else []
        plain, drafted = plain_levels[0], drafted_levels[0]  # concurrency 1: the check

    align_result = {"tau": tau, "specdiff_identical": spec_outputs == reference,
                    "ar_tokens_per_second": num_tokens / ar_seconds,
                    "specdiff_tokens_per_second": sum(map(len, spec_outputs)) / spec_seconds}
    plain_result, drafted_result = served(plain, reference), served(drafted, reference)
    ratio = drafted.mean_acceptance_length / tau
    ngram_result = served(ngram_levels[0], reference) if ngram_levels else None
    problems, note = identity_problems(
        {"align specdiff": align_result["specdiff_identical"], "vLLM": plain_result["identical"],
         "vLLM with the drafter": drafted_result["identical"],
         "vLLM with n-gram": ngram_result is None or ngram_result["identical"]}, vllm_dtype(verifier.dtype))
    if relative_gap(drafted.mean_acceptance_length, tau) > s.max_acceptance_gap:
        problems.append(f"vLLM mean acceptance length {drafted.mean_acceptance_length:.2f} is "
                        f"{relative_gap(drafted.mean_acceptance_length, tau):.0%} off align's τ {tau:.2f} "
                        f"(allowed {s.max_acceptance_gap:.0%})")
    result = {
        "align": align_result, "vllm_plain": plain_result, "vllm_drafter": drafted_result,
        "vllm_ngram": ngram_result,
        "concurrency": [by_concurrency(p, q, reference, n) for p, q, n in
                        zip(plain_levels, drafted_levels, ngram_levels or [None] * len(plain_levels))],
        "check": {"passed": not problems, "reason": "; ".join(problems), "note": note, "acceptance_ratio": ratio,
                  "max_acceptance_gap": s.max_acceptance_gap,
                  "vllm_speedup": drafted.tokens_per_second / plain.tokens_per_second},
        "meta": {"command": command, "recipe": recipe.to_dict(), "drafter": s.drafter, "drafter_format": kind,
                 "num_prompts": len(prompts), "max_new_tokens": d.max_new_tokens, "gamma": d.gamma,
                 "exported_speculative_tokens": exported,
                 "prompts_sha256": prompt_ids_sha256(prompt_ids), "dtype": vllm_dtype(verifier.dtype),
                 "vllm": plain.vllm_version, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 "machine": served_on()},
    }
    out = mark_folder(s.out, "serve_check")
    write_result(out / "serve_check.json", json.dumps(result, indent=2))  # kept elsewhere if the disk is full
    text = report(result)
    write_text_atomic(out / "report.md", text)
    print(text)
    print(f"wrote {out / 'serve_check.json'} and {out / 'report.md'}")
    if problems:
        print(f"align serve-check: failed: {result['check']['reason']}", file=sys.stderr)
        return EXIT_MISMATCH
    return None
