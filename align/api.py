"""The Python API: a verifier and its drafters, loaded once, decoding prompts with any method `align eval` measures.

    import align
    pair = align.load(verifier="checkpoints/tiny/verifier", drafter="checkpoints/tiny/drafter-base")
    results = pair.generate(["def add(a, b):", "def fib(n):"], method="specdiff_cps_adl", max_new_tokens=32)
    print(results[0].text, results[0].token_ids, results[0].stats.tau)

Shaped like vLLM's `LLM.generate`: load once, pass a list of prompts, get one result per prompt, in order. Every
default comes from the recipe schema (align/config.py), as `align eval` reads it: model settings (dtype, device,
trust_remote_code, attn_implementation, the drafter's spec fields) from its model sections, decode settings
(max_new_tokens, gamma, temperature, top_k, top_p, seed, the CPS and ADL settings...) from DecodeSection, the
chat-template mode from DataSection. Models are checked as every stage checks them (preflight.check_models) before any
weights load; bad input is a one-line RecipeError (a ValueError).

Unlike the decoding functions, which stop at EOS only when told, a generation here ends at the verifier's end tokens
by default (methods.eos_token_ids); `eos_token_id=[]` turns that off.
"""

from __future__ import annotations

import difflib
import operator
import os
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping, Optional, Sequence, Union

import torch
from pydantic import ValidationError

from align.config import METHOD_NAMES, DecodeSection, DrafterSection, ModelSection, Recipe, RecipeError
from align.data import chat_template as template_for, conversation, render_prompt
from align.decoding.generation import GenerationStats, Sampling
from align.decoding.options import METHOD_MODELS, method_name
from align.decoding.path_search import TrigramModel
from align.decoding.suffix import SuffixIndex
from align.drafters.loading import load_drafter
from align.drafters.spec import method_refusal
from align.methods import (METHODS, Setup, check_suffix_corpus, eos_token_ids, prompt_generator, proxy_source,
                           suffix_index, trigram_proxy)
from align.models import load_ar_drafter, load_tokenizer, load_verifier
from align.preflight import context_length, check_context, check_models
from align.recipe_files import one_line

# A model: a local folder or Hub id, or a mapping of its section's fields ({"path": ..., "trust_remote_code": True,
# "logits_shift": 1, ...}) for settings that differ between models.
ModelArg = Union[str, "os.PathLike[str]", Mapping[str, Any]]
# A prompt: text, chat messages ([{"role", "content"}], ending on the turn the model answers), or token ids as the
# verifier reads them (no template applied).
PromptArg = Union[str, Sequence[Mapping[str, str]], Sequence[int]]
EosArg = Union[None, int, Iterable[int]]

# Settings `load` takes for every model at once; a mapping given for one model overrides them for that model.
MODEL_SETTINGS = tuple(name for name in ModelSection.model_fields if name != "path")
DECODE_SETTINGS = tuple(DecodeSection.model_fields)
# What each model argument is called in a refusal (the recipe key check_models names -> the argument of `load`).
ROLES = {"drafter.path": ("a diffusion drafter", "drafter"), "ar_drafter.path": ("an AR drafter", "ar_drafter")}


@dataclass
class Generation:
    """One prompt's result."""

    prompt: Any  # as it was given
    prompt_token_ids: list[int]  # what the verifier read: the prompt rendered with the chat template, if any
    token_ids: list[int]  # the new tokens, up to and including the end token when one stopped the generation
    text: str  # the new tokens decoded, special tokens (the end token) left out
    finish_reason: Literal["stop", "length"]  # an end token, or max_new_tokens reached
    # τ, accepted and drafted lengths per iteration, forwards, times. HF's own methods (methods.OPAQUE) report forward
    # counts only: their τ is (new_tokens - 1) / verifier_forwards, by the function `align eval` uses
    # (decoding.generation.mean_accepted_length).
    stats: GenerationStats


class Pair:
    """A verifier with its drafters, loaded by `load`; `generate` decodes prompts with any of `METHODS`."""

    def __init__(self, recipe: Recipe, verifier: Any, tokenizer: Any, template: Optional[str], drafter: Any = None,
                 spec: Any = None, ar_drafter: Any = None, eos_ids: frozenset[int] = frozenset()) -> None:
        self.recipe = recipe  # the settings as the schema resolved them (the models' sections, decode, data)
        self.verifier, self.tokenizer = verifier, tokenizer
        self.chat_template = template  # what text and chat prompts are rendered with; None: plain text
        self.drafter, self.spec, self.ar_drafter = drafter, spec, ar_drafter
        self.eos_token_ids = eos_ids
        self._proxies: dict[str, TrigramModel] = {}
        self._suffixes: dict[str, SuffixIndex] = {}
        self._verify_costs: Optional[list[float]] = None  # the cost-aware methods' curve, measured on first use

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods the loaded models can run."""
        return tuple(name for name in METHOD_NAMES if not self._missing(name))

    def __repr__(self) -> str:
        parts = [f"verifier={self.recipe.verifier.path!r}"]
        if self.drafter is not None:
            parts.append(f"drafter={self.recipe.drafter.path!r}")
        if self.ar_drafter is not None:
            parts.append(f"ar_drafter={self.recipe.ar_drafter.path!r}")
        return f"Pair({', '.join(parts)}, device={self.verifier.device}, dtype={self.verifier.dtype})"

    def _missing(self, method: str) -> Optional[str]:
        """The recipe key of a model `method` needs that was not loaded, if any."""
        loaded = {"drafter.path": self.drafter, "ar_drafter.path": self.ar_drafter}
        return next((key for key in METHOD_MODELS.get(method, ()) if loaded[key] is None), None)

    def generate(self, prompts: Union[PromptArg, Sequence[PromptArg]], method: str = "specdiff", *,
                 eos_token_id: EosArg = None, **settings: Any) -> list[Generation]:
        """Decode each prompt with `method` (a name of align.methods.METHODS, or its options spelled as in
        align/decoding/options.py: specdiff+cps+tree), one after the other.

        prompts: a list of prompts, or one prompt (text, chat messages, or token ids); one Generation per prompt, in
        order. eos_token_id: the tokens that end a generation; None: the pair's (the verifier's generation_config and
        tokenizer, unless `load` was told otherwise); []: none, every generation runs to max_new_tokens.
        settings: DecodeSection fields for this call (max_new_tokens, gamma, temperature, top_k, top_p, seed, ...);
        unset ones keep the pair's. Greedy (temperature 0, the default) gives exactly the verifier's own greedy
        tokens with every method; sampling draws prompt i from its own generator, seeded from seed and i.
        """
        try:  # a name (specdiff_cps_tree) or a spelling of its options (specdiff+tree+cps): decoded as its name
            if not isinstance(method, str):
                raise ValueError(method)
            method = method_name(method)
        except ValueError:
            raise RecipeError(f"method {method!r}: unknown; the methods are {', '.join(METHODS)}") from None
        missing = self._missing(method)
        if missing:
            what, argument = ROLES[missing]
            raise RecipeError(f"method {method!r} needs {what}: pass align.load(..., {argument}=<folder or Hub id>) "
                              f"(methods the loaded models run: {', '.join(self.methods)})")
        why = method_refusal(self.spec.kind, method, self.recipe.drafter.path) if self.spec else None
        if why:
            raise RecipeError(f"method {method!r} {why}")
        decode = _validate({"decode": {**self.recipe.decode.model_dump(), **_settings(settings, DECODE_SETTINGS)}}
                           ).decode
        eos_ids = (self.eos_token_ids if eos_token_id is None
                   else _in_vocabulary(_eos(eos_token_id, "eos_token_id"), self.verifier, "eos_token_id"))
        batch = _as_list(prompts)
        context = context_length(self.verifier.config)
        encoded = [self._encode(i, prompt, decode.max_new_tokens, context) for i, prompt in enumerate(batch)]
        proxy = self._proxy(decode) if "cps" in method else None
        setup = Setup(self.verifier, self.drafter, self.spec, self.ar_drafter, self.tokenizer, eos_ids, decode, proxy,
                      decode.verify_costs_s or self._verify_costs, decode.draft_cost_s,
                      suffix=self._suffix(decode) if "suffix" in method else None)
        sampling = Sampling(decode.temperature, decode.top_k, decode.top_p)
        device = self.verifier.device
        results = []
        with torch.inference_mode():
            for i, (prompt, ids) in enumerate(zip(batch, encoded)):
                prompt_ids = torch.tensor([ids], dtype=torch.long, device=device)
                tokens, stats = METHODS[method](setup, prompt_ids, sampling, prompt_generator(decode.seed, i, device))
                stopped = bool(tokens) and tokens[-1] in eos_ids
                results.append(Generation(prompt, ids, tokens, self.tokenizer.decode(tokens, skip_special_tokens=True),
                                          "stop" if stopped else "length", stats))
        self._verify_costs = setup.verify_costs
        return results

    def _encode(self, index: int, prompt: Any, max_new_tokens: int, context: int) -> list[int]:
        """A prompt as the token ids the verifier reads: text and messages rendered as every stage renders them
        (data.render_prompt, with the chat template when the mode and the tokenizer give one), ids as they are."""
        where = f"prompt {index}"
        _unicode(where, prompt)
        if isinstance(prompt, str):
            ids = render_prompt(self.tokenizer, prompt, self.chat_template)
        elif _is_messages(prompt):
            # The stages' rule for a conversation (well-formed messages, trailing assistant turns cut, not only
            # assistant turns), so that a prompt reads the same here as in a prompt file.
            messages = conversation([dict(m) for m in prompt], where)
            if self.chat_template is None:
                why = "chat_template='off'" if self.recipe.data.chat_template == "off" else \
                    f"the tokenizer of {self.recipe.verifier.path} has none"
                raise RecipeError(f"{where}: chat messages need a chat template ({why}); pass text or token ids")
            ids = render_prompt(self.tokenizer, messages, self.chat_template)
        elif _is_ids(prompt):
            ids = [int(t) for t in prompt]
            vocab = self.verifier.config.get_text_config().vocab_size
            if not all(0 <= t < vocab for t in ids):
                raise RecipeError(f"{where}: token ids must lie in [0, {vocab}), the verifier's vocabulary")
        else:
            raise RecipeError(f"{where}: a prompt is text, chat messages ([{{'role', 'content'}}]) or token ids "
                              f"(got {type(prompt).__name__}: {str(prompt)[:80]})")
        if not ids:
            raise RecipeError(f"{where}: empty; the verifier needs at least one token to continue")
        check_context(where, len(ids), "max_new_tokens", max_new_tokens, context, "the verifier's")  # as every stage
        return ids

    def _suffix(self, decode: DecodeSection) -> SuffixIndex:
        """SuffixDecoding's index over decode.suffix_corpus (suffix_corpus=<trajectories folder>), built once."""
        recipe = self.recipe.model_copy(update={"decode": decode})
        key = str(check_suffix_corpus(recipe).resolve())
        if key not in self._suffixes:
            self._suffixes[key] = suffix_index(recipe)
        return self._suffixes[key]

    def _proxy(self, decode: DecodeSection) -> TrigramModel:
        """The CPS causal proxy of decode.cps_proxy_corpus (the tiny corpus by default), as `align eval` fits it:
        once, cached under data_dir/trigram/ and in this pair."""
        source = proxy_source(self.recipe.model_copy(update={"decode": decode}))
        key = str(source.resolve())
        if key not in self._proxies:
            self._proxies[key] = trigram_proxy(source, self.recipe.data.dir, self.tokenizer)
        return self._proxies[key]


def default_data_dir() -> str:
    """Where the Python API keeps what it builds for the CPS methods (the tiny corpus, the fitted proxy) unless told:
    a cache folder, as huggingface_hub keeps its own, rather than `data/tiny` under whatever folder the caller runs
    from (the CLI's recipes name their data folder)."""
    cache = os.environ.get("ALIGN_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "align")
    return os.path.join(os.path.expanduser(cache), "data")


def load(verifier: ModelArg, drafter: Optional[ModelArg] = None, ar_drafter: Optional[ModelArg] = None, *,
         chat_template: Optional[Literal["auto", "on", "off"]] = None, data_dir: Optional[str] = None,
         eos_token_id: EosArg = None, **settings: Any) -> Pair:
    """Load a verifier and the drafters the methods need; each a local folder or a Hub id.

    drafter: a diffusion drafter (the specdiff* methods); its DrafterSpec is read from its config as every stage reads
    it. ar_drafter: an autoregressive drafter (sd_ar, hf_assisted). ar, hf_generate, prompt_lookup, ngram and suffix
    need neither.
    chat_template: how text and chat prompts are rendered (data.chat_template): auto, with the verifier
    tokenizer's chat template when it has one; on: it must have one; off: plain text.
    data_dir: where the CPS proxy is cached and the tiny corpus it is fitted on by default is built (data.dir); None:
    $ALIGN_CACHE/data, by default ~/.cache/align/data (never the caller's working directory).
    eos_token_id: the tokens that end a generation; None: the verifier's generation_config and tokenizer's.
    settings: ModelSection fields for every model (dtype, device, trust_remote_code, attn_implementation; give a
    model as a mapping to set them for it alone, or the drafter's spec fields mask_token_id, logits_shift,
    attention), and DecodeSection fields as the defaults of `generate` (max_new_tokens, gamma, temperature, ...).
    """
    shared = _settings(settings, MODEL_SETTINGS + DECODE_SETTINGS)
    if data_dir is not None and os.path.exists(data_dir) and not os.path.isdir(data_dir):
        raise RecipeError(f"data_dir: {data_dir} is a file; name a folder to keep the CPS proxy's data in")
    tree: dict[str, Any] = {
        "decode": {k: v for k, v in shared.items() if k in DECODE_SETTINGS},
        "data": {k: v for k, v in (("chat_template", chat_template), ("dir", data_dir or default_data_dir()))
                 if v is not None},
    }
    models = {k: v for k, v in shared.items() if k in MODEL_SETTINGS}
    given = {"verifier": verifier, "drafter": drafter, "ar_drafter": ar_drafter}
    for name, value in given.items():
        if value is not None or name == "verifier":  # no verifier is no default one (the tiny family's)
            tree[name] = {**models, **_model(value, name)}
    recipe = _validate(tree)
    chosen_eos = None if eos_token_id is None else _eos(eos_token_id, "eos_token_id")  # checked before any loading
    # Configs and weights files only: a wrong folder, a drafter that is no diffusion drafter, mismatched vocabularies
    # are refused before seconds (or minutes, for a Hub model) go into loading weights.
    check_models(recipe, [f"{name}.path" for name, value in given.items() if value is not None])
    tokenizer = load_tokenizer(recipe.verifier.path, recipe.verifier.trust_remote_code)
    template = template_for(tokenizer, recipe.data.chat_template, recipe.verifier.path)
    model = load_verifier(recipe.verifier)
    diffusion, spec = load_drafter(recipe.drafter, tokenizer) if drafter is not None else (None, None)
    autoregressive = load_ar_drafter(recipe.ar_drafter) if ar_drafter is not None else None
    eos_ids = eos_token_ids(model, tokenizer) if chosen_eos is None else _in_vocabulary(chosen_eos, model,
                                                                                        "eos_token_id")
    return Pair(recipe, model, tokenizer, template, diffusion, spec, autoregressive, eos_ids)


# --------------------------------------------------------------------------------------------------------------------
# checking what the caller gave
# --------------------------------------------------------------------------------------------------------------------
def _validate(tree: dict[str, Any]) -> Recipe:
    """The recipe schema's checks and defaults, with its one-line refusals."""
    try:
        return Recipe.model_validate(tree)
    except ValidationError as e:
        raise RecipeError(one_line(e)) from None


def _settings(settings: dict[str, Any], known: tuple[str, ...]) -> dict[str, Any]:
    """The keyword settings, refused when one is not a field of the schema (with the closest name)."""
    for name in settings:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"settings: {', '.join(known)}"
            raise RecipeError(f"unknown setting {name!r} ({hint})")
    return settings


def _model(value: ModelArg, name: str) -> dict[str, Any]:
    if isinstance(value, (str, os.PathLike)):
        return {"path": os.fspath(value)}
    if isinstance(value, Mapping):
        fields = (DrafterSection if name == "drafter" else ModelSection).model_fields
        unknown = [k for k in value if k not in fields]
        if unknown:
            raise RecipeError(f"{name}: unknown field {unknown[0]!r} (fields: {', '.join(fields)})")
        if "path" not in value:
            raise RecipeError(f"{name}: a mapping needs its 'path' (a local folder or Hub id)")
        return dict(value)
    raise RecipeError(f"{name}: a local folder, a Hub id or a mapping of its settings (got {type(value).__name__})")


def _token_id(value: Any) -> Optional[int]:
    """An integer token id (an int, a numpy integer, a one-element integer tensor), or None. A bool is no id."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()  # a Python int, float or bool, checked as one
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # ints and numpy integers; floats, strings and the rest refuse
    except TypeError:
        return None


def _eos(value: EosArg, name: str) -> frozenset[int]:
    # A tensor is read as its ids: iterating a 0-d tensor raises, and a 1-d one yields tensors.
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        value = value.flatten().tolist()
    one = _token_id(value)
    items = [one] if one is not None else (
        [_token_id(t) for t in value] if isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping))
        and not isinstance(value, torch.Tensor) else [None])
    if any(t is None or t < 0 for t in items):
        raise RecipeError(f"{name}: a token id or a list of them ([]: never stop early), got {value!r:.80}")
    return frozenset(t for t in items if t is not None)


def _in_vocabulary(ids: frozenset[int], verifier: Any, name: str) -> frozenset[int]:
    """End ids the verifier can emit: an id past its output vocabulary would never end a generation."""
    vocab = verifier.get_output_embeddings().weight.shape[0]
    outside = sorted(t for t in ids if t >= vocab)
    if outside:
        raise RecipeError(f"{name}: {outside[0]} is outside the verifier's vocabulary ({vocab} tokens)")
    return ids


def _unicode(where: str, prompt: Any) -> None:
    """Text the tokenizer can read: a lone surrogate (from a bad decode upstream) raised a TypeError inside it."""
    texts = [prompt] if isinstance(prompt, str) else [m.get("content") for m in prompt if isinstance(m, Mapping)] \
        if _is_messages(prompt) else []
    for text in texts:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RecipeError(f"{where}: not valid Unicode text ({e.reason} at character {e.start})") from None


def _is_messages(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, Mapping) for m in value)


def _is_ids(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _as_list(prompts: Any) -> list[Any]:
    """A list of prompts, or one prompt (text, messages or ids) as a list of one."""
    if isinstance(prompts, str) or _is_messages(prompts) or _is_ids(prompts):
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        raise RecipeError("prompts: give token ids as a list of ints per prompt (tensor.tolist())")
    if not isinstance(prompts, (list, tuple)):
        raise RecipeError(f"prompts: a list of prompts (text, chat messages or token ids), got {type(prompts).__name__}")
    if not prompts:
        raise RecipeError("prompts: the list is empty; give at least one prompt")
    return list(prompts)
