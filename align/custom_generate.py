"""SpecDiff decoding from transformers alone: `align export` ships this file as `custom_generate/generate.py`.

    drafter = AutoModelForCausalLM.from_pretrained(folder)           # the Auto class the card names
    verifier = AutoModelForCausalLM.from_pretrained(verifier_id)
    out = verifier.generate(ids, assistant_model=drafter, custom_generate=folder, trust_remote_code=True,
                            max_new_tokens=64, return_dict_in_generate=True)
    out.sequences, out.tau                                           # tokens per verifier forward

A diffusion drafter proposes γ tokens in one forward (`context ⊕ [MASK]×γ`); the verifier scores them in one cached
forward and keeps the longest prefix the acceptance rule allows, plus one token of its own. Greedy output is
`generate()`'s greedy output token for token; with do_sample=True drafts are accepted by speculative sampling, so the
output is distributed exactly as the verifier's sampling. It is align's runtime (align/decoding/specdiff.py,
acceptance.py, models.py `block_logits`) restated in one file that imports torch and transformers only, because
transformers copies this file alone into its module cache: it must not import align (which may not be installed).

The drafter's `config.drafter_spec` says how to read it: `mask_token_id`, `logits_shift` (0: position t's prediction
is at logits[t]; 1: at logits[t-1]) and `attention` (`block_causal`: the context is causal, so its KV cache is exact
and only grows; `bidirectional`: the context is re-encoded for every draft).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import DynamicCache
from transformers.generation.utils import GenerateDecoderOnlyOutput


@dataclass
class SpecDiffOutput(GenerateDecoderOnlyOutput):
    """generate()'s output with what speculation achieved. tau: tokens emitted per verifier forward after the
    prefill (accepted drafts + 1, averaged over iterations); accept_counts: draft tokens kept, per iteration."""

    tau: Optional[float] = None
    accept_counts: Optional[list[int]] = None
    verifier_forwards: Optional[int] = None


# --------------------------------------------------------------------------------------------------------------------
# sampling: the distribution a token is drawn from is the one acceptance is computed against (or it is not lossless)
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k and top-p; one-hot at 0."""
        logits = logits.float()
        if self.temperature == 0:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        logits = logits / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # The smallest prefix whose mass reaches top_p: a token is dropped if the mass before it already does.
            drop = (sorted_probs.cumsum(-1) - sorted_probs) >= self.top_p
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def pick(self, logits: torch.Tensor) -> int:
        """One token from (V,) logits."""
        return int(logits.argmax()) if self.temperature == 0 else int(torch.multinomial(self.probs(logits), 1))


def sampling_from(config) -> Sampling:
    """transformers' settings -> ours: do_sample=False is greedy whatever the temperature says."""
    if not config.do_sample:
        return Sampling()
    return Sampling(config.temperature or 1.0, config.top_k or 0, 1.0 if config.top_p is None else config.top_p)


def accept(draft: torch.Tensor, draft_probs: Optional[torch.Tensor], verifier_logits: torch.Tensor,
           sampling: Sampling) -> tuple[int, int]:
    """(num_accepted, next_token): keep the first num_accepted draft tokens, then next_token (the correction at the
    first rejection, or the bonus token). draft: (γ,); draft_probs: (γ, V) the draft was sampled from, or None for
    an argmax draft; verifier_logits: (γ + 1, V)."""
    if sampling.temperature == 0:  # keep draft tokens while they equal the verifier's argmax: AR greedy exactly
        verifier_tokens = verifier_logits.argmax(-1)
        num_accepted = int((draft == verifier_tokens[:-1]).int().cumprod(0).sum())
        return num_accepted, int(verifier_tokens[num_accepted])
    verifier_probs = sampling.probs(verifier_logits)
    if draft_probs is None:  # a deterministic draft is a point mass, never the drafter's softmax
        draft_probs = torch.nn.functional.one_hot(draft, verifier_probs.shape[-1]).to(verifier_probs.dtype)
    # Speculative sampling: keep x_i with probability min(1, p_i(x_i) / q_i(x_i)) (u * q < p needs no division by a
    # q that underflowed to 0); at the first rejection sample norm(max(p - q, 0)).
    gamma = draft.shape[0]
    positions = torch.arange(gamma, device=draft.device)
    u = torch.rand(gamma, device=draft.device)
    kept = (u * draft_probs[positions, draft] < verifier_probs[positions, draft]).int().cumprod(0)
    num_accepted = int(kept.sum())
    if num_accepted == gamma:
        return gamma, int(torch.multinomial(verifier_probs[gamma], 1))
    diff = (verifier_probs[num_accepted] - draft_probs[num_accepted]).clamp_min(0)
    # Equal distributions leave no residual, but then a rejection has probability 0: never divide 0 by 0.
    residual = diff / diff.sum() if diff.sum() > 0 else verifier_probs[num_accepted]
    return num_accepted, int(torch.multinomial(residual, 1))


# --------------------------------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------------------------------
def rollback_cache(model) -> DynamicCache:
    """A KV cache that can be cropped back after a rejection: sliding-window layers otherwise drop what leaves the
    window and refuse to crop once it is full."""
    with torch.device(model.device):  # sliding layers make a tensor of their window size at construction
        cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    return cache


def forward(model, ids: torch.Tensor, cache: DynamicCache, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run (1, k) new tokens through `model`, extending its cache. Returns (1, k, V) logits."""
    start = cache.get_seq_length()
    positions = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0)
    return model(input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True).logits


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (q, k) -> float (1, 1, q, k): 0 where allowed, the dtype's minimum elsewhere (4-D bool masks are not
    handled alike by every attention kernel)."""
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=allowed.device), blocked)[None, None]


class Drafter:
    """Reads a diffusion drafter the way its DrafterSpec says; `propose` gives the logits of a block after a context.
    A block-causal drafter keeps an exact context cache that only grows: drafts never enter it."""

    def __init__(self, model):
        spec = getattr(model.config, "drafter_spec", None)
        if not spec:
            raise ValueError("assistant_model has no config.drafter_spec: pass the diffusion drafter exported by "
                             "align (its config.json carries the spec)")
        if spec.get("kind", "standalone") != "standalone" or spec.get("noise", "mask") != "mask" or \
                getattr(model.config, "is_encoder_decoder", False) or model.config.model_type == "diffusion_gemma":
            raise ValueError(f"this custom_generate decodes standalone masked drafters; drafter_spec kind "
                             f"{spec.get('kind')!r} with noise {spec.get('noise', 'mask')!r} (DFlash, DiffusionGemma) "
                             "needs align's runtime: align.decoding.specdiff.specdiff_generate")
        if spec["attention"] not in ("block_causal", "bidirectional") or spec["logits_shift"] not in (0, 1):
            raise ValueError(f"unknown drafter_spec {spec}")
        self.model, self.mask_token_id = model, spec["mask_token_id"]
        self.shift, self.cached = spec["logits_shift"], spec["attention"] == "block_causal"
        self.cache = rollback_cache(model) if self.cached else None
        self.last_logits: Optional[torch.Tensor] = None  # (V,): a shifted drafter's prediction for block position 0

    def propose(self, context: torch.Tensor, gamma: int) -> torch.Tensor:
        """context: (1, n) clean tokens -> (γ, V) logits for the γ positions after it."""
        context = context.to(self.model.device)  # the drafter may sit on another device than the verifier
        block = context.new_full((1, gamma), self.mask_token_id)
        if not self.cached:  # bidirectional: every position sees every other, so the context is re-encoded
            n = context.shape[1]
            logits = self.model(input_ids=torch.cat([context, block], dim=1)).logits[0]
            return logits[n - self.shift: n + gamma - self.shift]
        return self._cached_propose(context, block)

    def _cached_propose(self, context: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        # One forward for the context tokens not cached yet and the block (a draft costs one drafter call): the new
        # context tokens are causal, the block sees the whole context and itself.
        cached, n, gamma = self.cache.get_seq_length(), context.shape[1], block.shape[1]
        ids = torch.cat([context[:, cached:], block], dim=1)
        rows = torch.arange(cached, n + gamma, device=ids.device)
        allowed = torch.arange(n + gamma, device=ids.device)[None, :] <= rows[:, None]
        allowed[n - cached:] = True
        logits = forward(self.model, ids, self.cache, additive_mask(allowed, self.model.dtype))[0]
        self.cache.crop(-gamma)  # the block is a guess: it never stays in the context cache
        if n > cached:
            self.last_logits = logits[n - cached - 1]
        block_logits = logits[n - cached:]  # (γ, V)
        if not self.shift:
            return block_logits
        # Shifted: block position 0 is predicted by the last context position, position i by block position i-1.
        return torch.cat([self.last_logits[None], block_logits[:-1]], dim=0)


# --------------------------------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------------------------------
@torch.inference_mode()
def specdiff(verifier, drafter: Drafter, prompt: torch.Tensor, gamma: int, max_new_tokens: int, sampling: Sampling,
             eos_ids: frozenset[int]) -> tuple[list[int], list[int]]:
    """prompt: (1, n). Returns (new tokens, accepted draft tokens per iteration)."""
    # Invariant: the verifier's cache covers every token but the newest one.
    cache = rollback_cache(verifier)
    tokens = [sampling.pick(forward(verifier, prompt, cache)[0, -1])]
    accept_counts: list[int] = []
    while len(tokens) < max_new_tokens and eos_ids.isdisjoint(tokens):
        draft_len = min(gamma, max_new_tokens - len(tokens))  # never draft past the end: it would be thrown away
        context = torch.cat([prompt, prompt.new_tensor([tokens])], dim=1)
        draft_logits = drafter.propose(context, draft_len).to(prompt.device)  # (γ, V)
        draft_probs = None  # an argmax draft
        if sampling.temperature == 0:
            draft = draft_logits.argmax(-1)
        else:  # sampled from the verifier's settings applied to the drafter, and accepted against that distribution
            draft_probs = sampling.probs(draft_logits)
            draft = torch.multinomial(draft_probs, 1).squeeze(-1)
        verifier_logits = forward(verifier, torch.cat([context[:, -1:], draft[None]], dim=1), cache)[0]
        num_accepted, next_token = accept(draft, draft_probs, verifier_logits, sampling)
        cache.crop(-(draft_len - num_accepted))  # rejected drafts leave the cache; the kept ones are exact
        accept_counts.append(num_accepted)
        tokens += [*draft[:num_accepted].tolist(), next_token]
    # AR decoding's stopping rule: at max_new_tokens, and just after the first end-of-sequence token.
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1], accept_counts
    return tokens, accept_counts


def generate(model, inputs: Optional[torch.Tensor] = None, generation_config=None, logits_processor=None,
             stopping_criteria=None, prefix_allowed_tokens_fn=None, assistant_model=None, streamer=None,
             gamma: int = 8, **kwargs):
    """What `model.generate(..., custom_generate=<this repo>)` runs. model: the verifier (any causal LM);
    assistant_model: the diffusion drafter; inputs: (1, n) prompt ids. gamma: draft tokens per verifier forward.

    Returns (1, n + new) ids like generate(), or with return_dict_in_generate=True a SpecDiffOutput whose `tau` is
    the tokens per verifier forward. One prompt at a time: speculation accepts different lengths per sequence.
    """
    if assistant_model is None:
        raise ValueError("pass the diffusion drafter as assistant_model=")
    if logits_processor or stopping_criteria or prefix_allowed_tokens_fn or streamer:
        raise ValueError("SpecDiff's custom_generate takes no logits_processor, stopping_criteria, "
                         "prefix_allowed_tokens_fn or streamer: acceptance must see the plain distributions")
    prompt = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if prompt is None or prompt.dim() != 2 or prompt.shape[0] != 1:
        raise ValueError("SpecDiff's custom_generate decodes one prompt at a time: input ids of shape (1, n)")
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(mask.all()):
        raise ValueError("SpecDiff's custom_generate takes an unpadded prompt (attention_mask all ones)")
    config = copy.deepcopy(generation_config or model.generation_config)
    config.update(**{k: v for k, v in kwargs.items() if k not in ("synced_gpus", "negative_prompt_ids",
                                                                  "negative_prompt_attention_mask")})
    # Settings that change the verifier's distribution through logits processors, or decode several sequences: the
    # acceptance rule above would not see them, so the output would silently differ from generate()'s.
    unsupported = {name: getattr(config, name, None) for name, plain in (
        ("num_beams", 1), ("num_return_sequences", 1), ("repetition_penalty", 1.0), ("min_new_tokens", 0),
        ("no_repeat_ngram_size", 0), ("bad_words_ids", None), ("suppress_tokens", None)) if getattr(
        config, name, None) not in (None, plain)}
    if unsupported:
        raise ValueError(f"SpecDiff's custom_generate does not support {unsupported}: it samples the verifier's "
                         "plain distribution after temperature, top_k and top_p")
    prompt = prompt.to(model.device)
    max_new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt.shape[1]
    eos = config.eos_token_id
    eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else list(eos))
    tokens, accept_counts = specdiff(model, Drafter(assistant_model), prompt, gamma, max_new, sampling_from(config),
                                     eos_ids)
    sequences = torch.cat([prompt, prompt.new_tensor([tokens])], dim=1)
    if not config.return_dict_in_generate:
        return sequences
    tau = sum(n + 1 for n in accept_counts) / len(accept_counts) if accept_counts else 1.0
    return SpecDiffOutput(sequences=sequences, tau=tau, accept_counts=accept_counts,
                          verifier_forwards=len(accept_counts))
