"""The decoding methods by name: what `align eval` measures side by side and what the Python API (`align.api`) runs.

Each method is `fn(setup, prompt_ids (1, n), sampling, generator) -> (new tokens, stats)`; a `Setup` holds the models
and the decode settings. A name is parsed into options (align/decoding/options.py: `specdiff_cps_tree` is
`specdiff+cps+tree`), and the options pick the speculative step that runs. HF's own methods (`hf_generate`,
`hf_assisted`, `prompt_lookup`) call `verifier.generate()` and count forwards from the outside. Also here, shared by
both callers: the tokens that end a generation, each prompt's random stream, and the causal proxy the CPS methods
search with.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from align.config import DecodeSection, Recipe, RecipeError
from align.corpus import ensure_data
from align.data import eos_token_ids, load_trajectories  # eos_token_ids: the end-token rule, for the callers here
from align.decoding.adaptive_length import AdaptiveLength
from align.decoding.ar import ar_generate
from align.decoding.generation import GenerationStats, Sampling
from align.decoding.ngram import NgramLookup, NgramStep
from align.decoding.options import METHOD_NAMES, MethodOptions, parse_method
from align.decoding.path_search import PathSearch, TrigramModel
from align.decoding.sd_ar import ARDraftStep
from align.decoding.self_selection import SelectionStep
from align.decoding.sizing import CostAwareSize, DrafterGate, measure_verify_costs
from align.decoding.specdiff import PathStep, draft_choice
from align.decoding.speculative import Decoding, Step, speculative_generate
from align.decoding.suffix import FILE as SUFFIX_FILE, SuffixIndex
from align.decoding.timers import count_forwards
from align.decoding.tree import CandidateSource, TreeStep, ngram_source, suffix_source
from align.disk import atomic_folder, mark_folder
from align.drafters.spec import DrafterSpec, kind_methods


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
    # SuffixDecoding's index over the verifier's trajectories (the suffix methods), built once (`suffix_index`).
    suffix: Optional[SuffixIndex] = None
    # What the cost-aware methods learn as they decode (each size chooser's per-depth calibration and drafter cost,
    # the union's DrafterGate), kept from one prompt to the next as a server keeps it between requests: a 64-token
    # answer is ~30 steps, too few for the gate to learn four buckets afresh. Keyed by (method, role); every prompt
    # still decides from earlier steps only, so it stays lossless. `forget` empties it (a new run of prompts).
    learned: dict[tuple[str, str], Any] = field(default_factory=dict)

    def measured_costs(self, prompt_ids: torch.Tensor) -> list[float]:
        """This hardware's verifier cost curve, measured at the first call (after a context as long as this prompt
        plus half the new tokens: about where a generation's forwards run) and again only when a larger γ or tree
        needs more of it."""
        most = max(self.decode.gamma, self.decode.tree_nodes) + 1
        if self.verify_costs is None or len(self.verify_costs) < most:
            context = prompt_ids.shape[1] + self.decode.max_new_tokens // 2
            self.verify_costs = measure_verify_costs(self.verifier, context, most)
        return self.verify_costs

    def cost_aware_size(self, prompt_ids: torch.Tensor, method: str, role: str) -> CostAwareSize:
        """`method`'s size chooser for `role` (the drafter, or a candidate source) over the measured cost curve: the
        one its earlier prompts taught (`learned`), else a new one."""
        costs = self.measured_costs(prompt_ids)
        sizing = self.learned.get((method, role))
        if sizing is None or sizing.verify_s != costs:
            sizing = self.learned[(method, role)] = CostAwareSize(costs, self.draft_cost)
        return sizing

    def drafter_gate(self, method: str) -> DrafterGate:
        """`method`'s DrafterGate (a cost-sized union tree with a drafter), as its earlier prompts left it."""
        return self.learned.setdefault((method, "gate"), DrafterGate())

    def forget(self) -> None:
        """Drop what the methods learnt: the next prompt starts as the first of a run."""
        self.learned.clear()


# --------------------------------------------------------------------------------------------------------------------
# methods: name -> fn(setup, prompt_ids (1, n), sampling, generator) -> (new tokens, stats)
# --------------------------------------------------------------------------------------------------------------------
# What generate() takes from a model's generation_config.json besides these ids, it would apply on top of what every
# method decodes: a repetition penalty (Qwen2.5's instruct models ship one), min_p, no_repeat_ngram_size, ... .
GENERATION_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def ignored_generation_settings(model: Any) -> dict[str, Any]:
    """The settings of `model`'s generation config that no method applies (align's loops read none of them; the HF
    baselines are handed a config without them): what eval.json records of them."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    # what generate() returns and how it caches are no choice of token: left out
    return {k: v for k, v in config.to_diff_dict().items()
            if k not in GENERATION_IDS and k not in ("transformers_version", "use_cache", "cache_implementation")
            and not k.startswith(("_", "output_", "return_"))}


@contextlib.contextmanager
def neutral_generation_config(model: Any) -> Iterator[None]:
    """generate() with none of `model`'s generation_config.json settings but its special-token ids, so that the HF
    baselines decode the target align's own loops decode: the verifier's plain greedy or temperature/top-k/top-p
    distribution. transformers fills every setting a call leaves unset from the model's generation_config
    (GenerationMixin._prepare_generation_config), so the model's own is swapped for the call."""
    from transformers import GenerationConfig

    kept = model.generation_config
    model.generation_config = GenerationConfig(**{k: getattr(kept, k, None) for k in GENERATION_IDS})
    try:
        yield
    finally:
        model.generation_config = kept


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
    with neutral_generation_config(setup.verifier), count_forwards(setup.verifier) as verifier_calls, \
            count_forwards(assistant) as drafts:
        # An explicit mask: generate() would otherwise infer one hiding every prompt token equal to pad_token_id
        # (Qwen2's pad token is its <|endoftext|>, which prompts hold), and decode another prompt than the verifier's.
        out = setup.verifier.generate(
            prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=setup.decode.max_new_tokens,
            eos_token_id=sorted(setup.eos_ids) or None, pad_token_id=setup.tokenizer.pad_token_id, **mode, **extra,
        )
    tokens = out[0, prompt_ids.shape[1]:].tolist()
    stats = GenerationStats(new_tokens=len(tokens), verifier_forwards=verifier_calls[0] - 1,
                            drafter_forwards=drafts[0])
    return tokens, stats


def path_search(d: DecodeSection) -> PathSearch:
    """The CPS settings of a decode section (the methods with cps)."""
    return PathSearch(d.cps_beam_width, d.cps_threshold, d.cps_max_candidates, d.cps_weight)


def ngram_lookup(d: DecodeSection) -> NgramLookup:
    """The n-gram match of a decode section (ngram, specdiff_ngram_tree)."""
    return NgramLookup(d.ngram_max_match, d.ngram_min_match)


def candidate_sources(method: MethodOptions, s: Setup, ids: torch.Tensor
                      ) -> list[tuple[CandidateSource, Optional[CostAwareSize]]]:
    """The model-free sources a union tree merges (ngram, suffix), each with a cost-aware chooser of its own when the
    method is sized (a source's acceptance is learnt apart from the drafter's, over the same cost curve)."""
    d, sources = s.decode, []
    if "ngram" in method or method.base == "ngram":
        sources.append(ngram_source(ngram_lookup(d)))
    if "suffix" in method or method.base == "suffix":
        if s.suffix is None:
            raise RecipeError(f"{method.name}: SuffixDecoding needs its index: set decode.suffix_corpus to a "
                              "trajectories folder")
        sources.append(suffix_source(s.suffix, d.suffix_nodes, d.suffix_max_match, d.suffix_min_share))
    return [(source, s.cost_aware_size(ids, method.name, f"source {i}") if "cost" in method else None)
            for i, source in enumerate(sources)]


def suffix_index(recipe: Recipe) -> SuffixIndex:
    """SuffixDecoding's index over decode.suffix_corpus: the one saved in it (an exported drafter's folder), else built
    over a trajectories folder's rows, every prompt and answer. Checked before any model is loaded
    (`check_suffix_corpus`)."""
    corpus = check_suffix_corpus(recipe)
    if (corpus / SUFFIX_FILE).is_file():
        try:
            return SuffixIndex.load(corpus)
        except ValueError as e:
            raise RecipeError(f"decode.suffix_corpus: {e}; export it again, or name the trajectories folder") from None
    rows = load_trajectories(corpus)
    return SuffixIndex.build(p + c for p, c in zip(rows["prompt_ids"], rows["completion_ids"]))


def check_suffix_corpus(recipe: Recipe) -> Path:
    """decode.suffix_corpus, which the suffix methods need: a trajectories folder, or a folder holding a saved index
    (`align export` writes suffix_index.npz beside the drafter). A one-line RecipeError otherwise."""
    corpus = recipe.decode.suffix_corpus
    if corpus is None:
        raise RecipeError("decode.suffix_corpus: the suffix methods draft from the verifier's trajectories; set it to "
                          "a trajectories folder (align trajectories' out) or an export holding suffix_index.npz")
    if not ((Path(corpus) / "manifest.json").is_file() or (Path(corpus) / SUFFIX_FILE).is_file()):
        raise RecipeError(f"decode.suffix_corpus: {corpus} is neither a trajectories folder (no manifest.json) nor "
                          f"an export holding {SUFFIX_FILE}")
    return Path(corpus)


def speculative_step(method: MethodOptions, s: Setup, ids: torch.Tensor, decoding: Decoding,
                     generator: Optional[torch.Generator]) -> Step:
    """The step a speculative method's options name, with the decode section's settings."""
    d = s.decode
    sizing = s.cost_aware_size(ids, method.name, "draft") if "cost" in method else None
    if method.base == "ngram":
        return NgramStep(s.verifier, decoding, ngram_lookup(d), generator, sizing)
    if method.base == "suffix":  # a union tree of the model-free sources alone
        return TreeStep(s.verifier, None, None, decoding, d.tree_nodes, generator, sizing, None,
                        candidate_sources(method, s, ids))
    if method.base == "sd_ar":
        return ARDraftStep(s.verifier, s.ar_drafter, decoding, decoding.sampling, generator)
    if "select" in method:
        return SelectionStep(s.verifier, s.drafter, s.spec, decoding, d.num_candidates, d.draft_temperature, generator)
    search = (path_search(d), s.proxy) if "cps" in method else None
    if "tree" in method:
        sources = candidate_sources(method, s, ids)
        gate = s.drafter_gate(method.name) if sizing is not None and sources else None
        return TreeStep(s.verifier, s.drafter, s.spec, decoding, d.tree_nodes, generator, sizing, search, sources,
                        gate)
    adaptive = AdaptiveLength(d.adl_min_len, d.adl_max_len, d.adl_delta, d.adl_rho) if "adl" in method else None
    choose = draft_choice(decoding.sampling, generator, argmax_draft=d.draft_choice == "argmax", path_search=search,
                          eos_ids=decoding.eos_ids)
    return PathStep(s.verifier, s.drafter, s.spec, decoding, choose, generator, adaptive, sizing)


MethodFn = Callable[[Setup, torch.Tensor, Sampling, Optional[torch.Generator]], tuple[list[int], GenerationStats]]


def method_fn(method: MethodOptions) -> MethodFn:
    """What runs `method`: HF's generate for its own methods, the AR loop, or the speculative loop with its step."""
    def run(s: Setup, ids: torch.Tensor, sampling: Sampling, gen: Optional[torch.Generator]):
        d = s.decode
        if method.base == "ar":
            return ar_generate(s.verifier, ids, d.max_new_tokens, sampling, s.eos_ids, gen)
        if method.base == "hf_generate":
            return _hf(s, ids, sampling, gen)
        if method.base == "hf_assisted":
            return _hf(s, ids, sampling, gen, assistant_model=s.ar_drafter)
        if method.base == "prompt_lookup":
            return _hf(s, ids, sampling, gen, prompt_lookup_num_tokens=d.prompt_lookup_tokens)
        decoding = Decoding(d.gamma, d.max_new_tokens, sampling, s.eos_ids)
        return speculative_generate(s.verifier, ids, speculative_step(method, s, ids, decoding, gen), decoding, gen)

    run.__name__ = run.__qualname__ = method.name
    return run


# Every method by name (align/decoding/options.py's METHOD_NAMES, which the recipe schema checks names against).
METHODS: dict[str, MethodFn] = {name: method_fn(parse_method(name)) for name in METHOD_NAMES}


def prompt_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    """Prompt `index`'s random stream: its own seed, so a prompt samples the same tokens whatever runs before it, on
    the prompt's device (a CPU generator cannot drive sampling on a GPU)."""
    return torch.Generator(device=device).manual_seed(seed * 100_003 + index)


def base_method(name: str) -> str:
    """`specdiff@aligned` (a method run with one of eval.compare_drafters) -> `specdiff`."""
    return name.split("@", 1)[0]


# What a DFlash drafter runs (align/drafters/spec.py's REFUSED_METHODS says what it does not, and why).
DFLASH_METHODS = kind_methods("dflash")
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
    # trigram/ marked too: data.dir may hold nothing but align's marked folders (checkpoint.check_output_owner), and
    # an unmarked trigram/ in a data.dir of its own (not bootstrap's) made the next stage refuse the folder.
    mark_folder(folder.parent, "data")
    with atomic_folder(folder, "data") as tmp:
        model.save(tmp, source=str(source))
    return model
