"""The decoding methods by name: what `align eval` measures side by side and what the Python API (`align.api`) runs.

Each method is `fn(setup, prompt_ids (1, n), sampling, generator) -> (new tokens, stats)`; a `Setup` holds the models
and the decode settings. HF's own methods (`hf_generate`, `hf_assisted`, `prompt_lookup`) call `verifier.generate()`
and count forwards from the outside. Also here, shared by both callers: the tokens that end a generation, each
prompt's random stream, and the causal proxy the CPS methods search with.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from align.checkpoint import atomic_folder
from align.config import METHOD_NAMES, DecodeSection, Recipe, RecipeError
from align.corpus import ensure_data
from align.data import load_trajectories
from align.decoding.adl import AdaptiveLength
from align.decoding.ar import ar_generate
from align.decoding.cps import PathSearch, TrigramModel
from align.decoding.generation import GenerationStats, Sampling
from align.decoding.sd_ar import sd_ar_generate
from align.decoding.sizing import CostAwareSize, measure_verify_costs
from align.decoding.specdiff import specdiff_generate
from align.decoding.specdiff2 import specdiff2_select_generate
from align.decoding.timers import count_forwards
from align.decoding.tree import specdiff_tree_generate
from align.models import DrafterSpec


@dataclass
class Setup:
    """Everything a method needs besides the prompt."""

    verifier: Any
    drafter: Any
    spec: DrafterSpec
    ar_drafter: Any
    tokenizer: Any
    eos_ids: frozenset[int]
    decode: DecodeSection
    proxy: Optional[TrigramModel] = None
    # The cost-aware methods' verifier cost curve (seconds per forward over n = 1.. new tokens), measured once.
    verify_costs: Optional[list[float]] = None
    # A drafter pass's seconds for the cost-aware methods, when fixed in advance (None: measured as they run).
    draft_cost: Optional[float] = None

    def measured_costs(self, prompt_ids: torch.Tensor) -> list[float]:
        """This hardware's verifier cost curve, measured at the first call (after a context as long as this prompt
        plus half the new tokens: about where a generation's forwards run) and again only when a larger γ or tree
        needs more of it."""
        most = max(self.decode.gamma, self.decode.tree_nodes) + 1
        if self.verify_costs is None or len(self.verify_costs) < most:
            context = prompt_ids.shape[1] + self.decode.max_new_tokens // 2
            self.verify_costs = measure_verify_costs(self.verifier, context, most)
        return self.verify_costs

    def cost_aware_size(self, prompt_ids: torch.Tensor) -> CostAwareSize:
        """A fresh per-generation size chooser over the measured cost curve."""
        return CostAwareSize(self.measured_costs(prompt_ids), self.draft_cost)


# --------------------------------------------------------------------------------------------------------------------
# methods: name -> fn(setup, prompt_ids (1, n), sampling, generator) -> (new tokens, stats)
# --------------------------------------------------------------------------------------------------------------------
def _hf(setup: Setup, prompt_ids: torch.Tensor, sampling: Sampling, generator: Optional[torch.Generator],
        **extra: Any) -> tuple[list[int], GenerationStats]:
    if sampling.temperature > 0:
        # HF samples from the global RNG: seed it from our generator so runs are reproducible.
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator,
                                            device=generator.device if generator is not None else None)))
        mode = dict(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    else:
        mode = dict(do_sample=False, temperature=None, top_k=None, top_p=None)
    assistant = extra.get("assistant_model") or torch.nn.Identity()
    with count_forwards(setup.verifier) as verifier_calls, count_forwards(assistant) as drafts:
        out = setup.verifier.generate(
            prompt_ids, max_new_tokens=setup.decode.max_new_tokens, eos_token_id=sorted(setup.eos_ids) or None,
            pad_token_id=setup.tokenizer.pad_token_id, **mode, **extra,
        )
    tokens = out[0, prompt_ids.shape[1]:].tolist()
    stats = GenerationStats(new_tokens=len(tokens), verifier_forwards=verifier_calls[0] - 1,
                            drafter_forwards=drafts[0])
    return tokens, stats


def run_ar(s: Setup, ids: torch.Tensor, sampling: Sampling, gen: Optional[torch.Generator]):
    return ar_generate(s.verifier, ids, s.decode.max_new_tokens, sampling, s.eos_ids, gen)


def run_hf_generate(s: Setup, ids: torch.Tensor, sampling: Sampling, gen: Optional[torch.Generator]):
    return _hf(s, ids, sampling, gen)


def run_hf_assisted(s: Setup, ids: torch.Tensor, sampling: Sampling, gen: Optional[torch.Generator]):
    return _hf(s, ids, sampling, gen, assistant_model=s.ar_drafter)


def run_prompt_lookup(s: Setup, ids: torch.Tensor, sampling: Sampling, gen: Optional[torch.Generator]):
    return _hf(s, ids, sampling, gen, prompt_lookup_num_tokens=s.decode.prompt_lookup_tokens)


def run_sd_ar(s: Setup, ids: torch.Tensor, sampling: Sampling, gen: Optional[torch.Generator]):
    return sd_ar_generate(s.verifier, s.ar_drafter, ids, s.decode.gamma, s.decode.max_new_tokens, sampling,
                          eos_ids=s.eos_ids, generator=gen)


def path_search(d: DecodeSection) -> PathSearch:
    """The CPS settings of a decode section (specdiff_cps* and specdiff_cps_tree)."""
    return PathSearch(d.cps_beam_width, d.cps_threshold, d.cps_max_candidates, d.cps_weight)


def _specdiff(s: Setup, ids: torch.Tensor, sampling: Sampling, gen: Optional[torch.Generator], cps: bool, adl: bool,
              cost: bool = False):
    d = s.decode
    search = (path_search(d), s.proxy) if cps else None
    adaptive = AdaptiveLength(d.adl_min_len, d.adl_max_len, d.adl_delta, d.adl_rho) if adl else None
    return specdiff_generate(s.verifier, s.drafter, s.spec, ids, d.gamma, d.max_new_tokens, sampling,
                             eos_ids=s.eos_ids, generator=gen, path_search=search, adaptive=adaptive,
                             argmax_draft=d.draft_choice == "argmax", sizing=s.cost_aware_size(ids) if cost else None)


def run_specdiff2_select(s: Setup, ids: torch.Tensor, sampling: Sampling, gen: Optional[torch.Generator]):
    d = s.decode
    return specdiff2_select_generate(s.verifier, s.drafter, s.spec, ids, d.gamma, d.max_new_tokens,
                                     d.num_candidates, d.draft_temperature, sampling, s.eos_ids, gen)


def run_specdiff_tree(s: Setup, ids: torch.Tensor, sampling: Sampling, gen: Optional[torch.Generator],
                      cost: bool = False, cps: bool = False):
    d = s.decode
    return specdiff_tree_generate(s.verifier, s.drafter, s.spec, ids, d.gamma, d.tree_nodes, d.max_new_tokens,
                                  sampling, s.eos_ids, gen, sizing=s.cost_aware_size(ids) if cost else None,
                                  path_search=(path_search(d), s.proxy) if cps else None)


MethodFn = Callable[[Setup, torch.Tensor, Sampling, Optional[torch.Generator]], tuple[list[int], GenerationStats]]
METHODS: dict[str, MethodFn] = {
    "ar": run_ar,
    "hf_generate": run_hf_generate,
    "hf_assisted": run_hf_assisted,
    "prompt_lookup": run_prompt_lookup,
    "sd_ar": run_sd_ar,
    "specdiff": lambda s, i, p, g: _specdiff(s, i, p, g, cps=False, adl=False),
    "specdiff2_select": run_specdiff2_select,
    "specdiff_cps": lambda s, i, p, g: _specdiff(s, i, p, g, cps=True, adl=False),
    "specdiff_adl": lambda s, i, p, g: _specdiff(s, i, p, g, cps=False, adl=True),
    "specdiff_cps_adl": lambda s, i, p, g: _specdiff(s, i, p, g, cps=True, adl=True),
    "specdiff_tree": run_specdiff_tree,
    "specdiff_cost": lambda s, i, p, g: _specdiff(s, i, p, g, cps=False, adl=False, cost=True),
    "specdiff_cps_cost": lambda s, i, p, g: _specdiff(s, i, p, g, cps=True, adl=False, cost=True),
    "specdiff_tree_cost": lambda s, i, p, g: run_specdiff_tree(s, i, p, g, cost=True),
    "specdiff_cps_tree": lambda s, i, p, g: run_specdiff_tree(s, i, p, g, cps=True),
    "specdiff_cps_tree_cost": lambda s, i, p, g: run_specdiff_tree(s, i, p, g, cost=True, cps=True),
}
assert tuple(METHODS) == METHOD_NAMES, "align/config.py's METHOD_NAMES must list METHODS"


def eos_token_ids(verifier: Any, tokenizer: Any) -> frozenset[int]:
    """The tokens that end a generation: the verifier's generation_config.eos_token_id (an int or a list: instruct
    models list their end-of-turn token there, which the tokenizer's single eos_token may not be) and the tokenizer's
    eos_token_id."""
    configured = getattr(getattr(verifier, "generation_config", None), "eos_token_id", None)
    configured = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    own = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return frozenset(int(t) for t in (*configured, *own))


def prompt_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    """Prompt `index`'s random stream: its own seed, so a prompt samples the same tokens whatever runs before it, on
    the prompt's device (a CPU generator cannot drive sampling on a GPU)."""
    return torch.Generator(device=device).manual_seed(seed * 100_003 + index)


def base_method(name: str) -> str:
    """`specdiff@aligned` (a method run with one of eval.compare_drafters) -> `specdiff`."""
    return name.split("@", 1)[0]


# What a DFlash drafter runs: one block per draft (SpecDiff), with path search and adaptive length on top. Several
# candidates from one pass (specdiff2_select) would need the block batched over its context K/V: not done yet. A draft
# tree (specdiff_tree) needs one block: the accepted path's verifier states join the drafter's context.
DFLASH_METHODS = ("specdiff", "specdiff_cps", "specdiff_adl", "specdiff_cps_adl", "specdiff_tree", "specdiff_cost",
                  "specdiff_cps_cost", "specdiff_tree_cost", "specdiff_cps_tree", "specdiff_cps_tree_cost")
BASELINES = ("ar", "hf_generate")
# HF's own methods: their draft lengths and acceptances are internal, so only τ (from forward counts) is reported.
OPAQUE = ("hf_generate", "hf_assisted", "prompt_lookup")


# --------------------------------------------------------------------------------------------------------------------
# the CPS causal proxy (specdiff_cps*)
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
    with atomic_folder(folder, "data") as tmp:
        model.save(tmp, source=str(source))
    return model
