"""SpecDiff decoding from transformers alone: `align export` ships this file as `custom_generate/generate.py`.

    drafter = AutoModelForCausalLM.from_pretrained(folder)           # the Auto class the card names
    verifier = AutoModelForCausalLM.from_pretrained(verifier_id)
    out = verifier.generate(ids, assistant_model=drafter, custom_generate=folder, trust_remote_code=True,
                            max_new_tokens=64, return_dict_in_generate=True)
    out.sequences, out.tau                                           # tokens per verifier forward

A diffusion drafter proposes γ tokens in one forward (`context ⊕ [MASK]×γ`); the verifier scores them in one cached
forward and keeps the longest prefix the acceptance rule allows, plus one token of its own. The generation config is
prepared and the tokens chosen by generate()'s own code (`_prepare_generation_config`, `_get_logits_processor`: its
defaults, such as top_k=50 and 20 new tokens, and every logits processor and warper), applied at each draft position
after its own prefix: greedy output is `generate()`'s greedy output token for token; with do_sample=True drafts are
accepted by speculative sampling against those processed distributions, so the output is distributed exactly as
`generate(do_sample=True)`'s. What it cannot reproduce (beams, stop strings, guidance, ...) it refuses by name. It is
align's runtime (align/decoding/specdiff.py,
acceptance.py, align/drafters `block_logits`) restated in one file that imports torch and transformers only, because
transformers copies this file alone into its module cache: it must not import align (which may not be installed).

The drafter's `config.drafter_spec` says how to read it: `mask_token_id`, `logits_shift` (0: position t's prediction
is at logits[t]; 1: at logits[t-1]) and `attention` (`block_causal`: the context is causal, so its KV cache is exact
and only grows; `bidirectional`: the context is re-encoded for every draft). A block-causal drafter's forwards take
an explicit block mask, per layer type and through each sliding layer's window as the model's own masks would be
(`block_masks`, masks.py `attention_masks` restated): its sliding cache layers hand back only the window's keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from transformers import DynamicCache
from transformers.generation import GenerationMode, LogitsProcessorList
from transformers.generation.utils import GenerateDecoderOnlyOutput


@dataclass
class SpecDiffOutput(GenerateDecoderOnlyOutput):
    """generate()'s output with what speculation achieved. tau: tokens emitted per verifier forward after the
    prefill (accepted drafts + 1, averaged over iterations); accept_counts: draft tokens kept, per iteration."""

    tau: Optional[float] = None
    accept_counts: Optional[list[int]] = None
    verifier_forwards: Optional[int] = None


# --------------------------------------------------------------------------------------------------------------------
# choosing a token: generate()'s own logits processors, and the distribution acceptance is computed against
# --------------------------------------------------------------------------------------------------------------------
class TokenChoice:
    """How `generate()` picks the next token: the logits processors its own `_get_logits_processor` builds from the
    prepared generation config (so that every setting, default and warper means here what it means there), then the
    argmax (greedy) or a draw from the softmax of the processed scores (do_sample). A processor reads the tokens
    before the position it scores, so each draft position is processed after its own prefix, the draft tokens before
    it included, as generate() would have processed it had it decoded those tokens one by one."""

    def __init__(self, processors: LogitsProcessorList, do_sample: bool) -> None:
        self.processors, self.do_sample = processors, do_sample

    def scores(self, prefix: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """prefix: (1, L) the tokens before the position; logits: (V,) -> (V,) processed float32 scores (a copy:
        generate() processes a float32 copy of the logits, and some processors write in place)."""
        scores = logits.to(dtype=torch.float32, copy=True)[None]
        return self.processors(prefix, scores)[0] if self.processors else scores[0]

    def probs(self, prefix: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """(V,) the distribution the token after `prefix` is drawn from: one-hot at the argmax when greedy."""
        scores = self.scores(prefix, logits)
        if not self.do_sample:
            return torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1]).float()
        return torch.softmax(scores, dim=-1)

    def positions(self, context: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """(k + 1, V) distributions of the positions after context, context + tokens[:1], ..., context + tokens:
        logits (k + 1, V) are the model's predictions there. context: (1, n); tokens: (k,)."""
        ids = torch.cat([context, tokens[None]], dim=1)
        n = context.shape[1]
        return torch.stack([self.probs(ids[:, : n + i], logits[i]) for i in range(logits.shape[0])])

    def pick(self, prefix: torch.Tensor, logits: torch.Tensor) -> int:
        """One token after `prefix` from its (V,) logits."""
        probs = self.probs(prefix, logits)
        return int(probs.argmax()) if not self.do_sample else int(torch.multinomial(probs, 1))

    def draft(self, context: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(γ,) draft tokens from the drafter's (γ, V) logits after context (1, n), each position processed after
        the draft tokens before it; and, sampled, the (γ, V) distributions they were drawn from (acceptance must be
        computed against those), None for an argmax draft."""
        tokens: list[int] = []
        probs = []
        for i in range(logits.shape[0]):
            prefix = torch.cat([context, context.new_tensor([tokens])], dim=1) if tokens else context
            q = self.probs(prefix, logits[i])
            probs.append(q)
            tokens.append(int(torch.multinomial(q, 1)) if self.do_sample else int(q.argmax()))
        draft = context.new_tensor(tokens)
        return draft, torch.stack(probs) if self.do_sample else None


def accept(draft: torch.Tensor, draft_probs: Optional[torch.Tensor], verifier_probs: torch.Tensor,
           do_sample: bool) -> tuple[int, int]:
    """(num_accepted, next_token): keep the first num_accepted draft tokens, then next_token (the correction at the
    first rejection, or the bonus token). draft: (γ,); draft_probs: (γ, V) the draft was sampled from, or None for
    an argmax draft; verifier_probs: (γ + 1, V), TokenChoice.positions of the verifier's logits."""
    if not do_sample:  # keep draft tokens while they equal the verifier's argmax: AR greedy exactly
        verifier_tokens = verifier_probs.argmax(-1)
        num_accepted = int((draft == verifier_tokens[:-1]).int().cumprod(0).sum())
        return num_accepted, int(verifier_tokens[num_accepted])
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


# The layer types a block-causal drafter's block mask is built for (as align's models.MASK_LAYER_TYPES).
MASK_LAYER_TYPES = ("full_attention", "sliding_attention")


def drafter_layer_types(model) -> list[str]:
    """Each layer's attention type, as transformers' cache and masks read the config (`get_layer_types_and_kwargs`):
    its `layer_types`, or for a config without them (Mistral, Phi-3) sliding for every layer when `sliding_window` is
    set, chunked when `attention_chunk_size` is. Refuses layers whose masks block_masks cannot build (chunked, linear
    attention, ...), before any work."""
    config = model.config.get_text_config(decoder=True)
    declared = getattr(config, "layer_types", None)
    if declared:
        types = list(declared)
    elif getattr(config, "sliding_window", None) is not None:
        types = ["sliding_attention"] * config.num_hidden_layers
    elif getattr(config, "attention_chunk_size", None) is not None:
        types = ["chunked_attention"] * config.num_hidden_layers
    else:
        types = ["full_attention"] * config.num_hidden_layers
    unknown = set(types) - set(MASK_LAYER_TYPES)
    if unknown:
        raise ValueError(f"this custom_generate builds a block-causal drafter's masks for "
                         f"{' and '.join(MASK_LAYER_TYPES)} layers only; the drafter has {', '.join(sorted(unknown))} "
                         "layers")
    return types


def block_masks(model, cache: DynamicCache, layer_types: list[str], allowed: torch.Tensor,
                positions: torch.Tensor):
    """The additive masks of a forward of q new tokens over what `cache` holds. allowed: bool (q, q), which new
    tokens each new token attends to; positions: (q,) theirs. Every new token also sees the cached keys its layer's
    cache hands back (`get_mask_sizes`: all of a full layer's, the last window−1 of a sliding layer's), and a sliding
    layer's mask hides every key `sliding_window` or more positions before the query, as the model's own mask would.
    Returns (1, 1, q, kv) additive masks: one tensor for a config without `layer_types` (Llama, Mistral), else a
    dict per layer type, which such models take (Qwen2, Gemma)."""
    q = allowed.shape[0]
    window = model.config.get_text_config(decoder=True).sliding_window if "sliding_attention" in layer_types else None

    def mask_for(layer_type: str) -> torch.Tensor:
        sliding = layer_type == "sliding_attention"
        layer_idx = cache.is_sliding.index(sliding) if sliding in cache.is_sliding else 0
        kv_length, offset = cache.get_mask_sizes(q, layer_idx)
        cached_keys = kv_length - q
        key_positions = torch.cat([torch.arange(offset, offset + cached_keys, device=positions.device), positions])
        sees = torch.cat([allowed.new_ones(q, cached_keys), allowed], dim=1)  # (q, kv)
        if sliding:
            sees = sees & (key_positions[None, :] > positions[:, None] - window)
        return additive_mask(sees, model.dtype)

    if getattr(model.config.get_text_config(decoder=True), "layer_types", None):
        return {layer_type: mask_for(layer_type) for layer_type in set(layer_types)}
    return mask_for(layer_types[0])  # without `layer_types`, every layer is of one type (drafter_layer_types)


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
        # Checked now, before any work: the block mask is built here for these layer types only.
        self.layer_types = drafter_layer_types(model) if self.cached else None
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
        # context tokens are causal, the block sees the whole context and itself (the cached context through each
        # sliding layer's window: its cache hands back only the window's keys).
        cached, n, gamma = self.cache.get_seq_length(), context.shape[1], block.shape[1]
        ids = torch.cat([context[:, cached:], block], dim=1)
        positions = torch.arange(cached, n + gamma, device=ids.device)
        allowed = torch.ones(n - cached + gamma, n - cached + gamma, dtype=torch.bool, device=ids.device).tril()
        allowed[n - cached:] = True
        mask = block_masks(self.model, self.cache, self.layer_types, allowed, positions)
        logits = forward(self.model, ids, self.cache, mask)[0]
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
def specdiff(verifier, drafter: Drafter, prompt: torch.Tensor, gamma: int, max_new_tokens: int, choice: TokenChoice,
             eos_ids: frozenset[int]) -> tuple[list[int], list[int]]:
    """prompt: (1, n). Returns (new tokens, accepted draft tokens per iteration)."""
    # Invariant: the verifier's cache covers every token but the newest one.
    cache = rollback_cache(verifier)
    tokens = [choice.pick(prompt, forward(verifier, prompt, cache)[0, -1])]
    accept_counts: list[int] = []
    while len(tokens) < max_new_tokens and eos_ids.isdisjoint(tokens):
        draft_len = min(gamma, max_new_tokens - len(tokens))  # never draft past the end: it would be thrown away
        context = torch.cat([prompt, prompt.new_tensor([tokens])], dim=1)
        draft_logits = drafter.propose(context, draft_len).to(prompt.device)  # (γ, V)
        # Drawn (or the argmax taken) after the verifier's processors applied to the drafter, and accepted against
        # exactly those distributions.
        draft, draft_probs = choice.draft(context, draft_logits)
        verifier_logits = forward(verifier, torch.cat([context[:, -1:], draft[None]], dim=1), cache)[0]
        num_accepted, next_token = accept(draft, draft_probs, choice.positions(context, draft, verifier_logits),
                                          choice.do_sample)
        cache.crop(-(draft_len - num_accepted))  # rejected drafts leave the cache; the kept ones are exact
        accept_counts.append(num_accepted)
        tokens += [*draft[:num_accepted].tolist(), next_token]
    # AR decoding's stopping rule: at max_new_tokens, and just after the first end-of-sequence token.
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1], accept_counts
    return tokens, accept_counts


# Settings of generate() this loop refuses, each with its plain value(s) and why (every other setting is generate()'s
# own: its logits processors and warpers are built by generate's code, see TokenChoice). Decoding modes other than
# greedy and sampling (beams, contrastive search, DoLa, constraints) are refused by their GenerationMode.
REFUSED = {
    "num_return_sequences": ((None, 1), "decodes one sequence per prompt"),
    "guidance_scale": ((None, 1, 1.0), "classifier-free guidance runs the verifier again on its own cache"),
    "watermarking_config": ((None,), "SynthID watermarking keeps state across calls, which drafts would enter"),
    "stop_strings": ((None,), "stops at end tokens and at the length only"),
    "max_time": ((None,), "stops at end tokens and at the length only"),
    "token_healing": ((None, False), "does not rewrite the prompt"),
    "prompt_lookup_num_tokens": ((None,), "drafts with assistant_model, the diffusion drafter"),
    "num_assistant_tokens_schedule": ((None, "constant"), "drafts gamma (num_assistant_tokens) tokens every step"),
    "assistant_early_exit": ((None,), "drafts with assistant_model, the diffusion drafter"),
    "use_mtp": ((None, False), "drafts with assistant_model, the diffusion drafter"),
    "output_scores": ((None, False), "returns sequences and τ, no scores"),
    "output_logits": ((None, False), "returns sequences and τ, no logits"),
    "output_attentions": ((None, False), "returns sequences and τ, no attentions"),
    "output_hidden_states": ((None, False), "returns sequences and τ, no hidden states"),
}


def refuse(what: str, why: str) -> None:
    raise ValueError(f"SpecDiff's custom_generate does not support {what}: it {why}")


DEFAULT_GAMMA = 8  # draft tokens per verifier forward when neither gamma nor num_assistant_tokens is given


def generate(model, inputs: Optional[torch.Tensor] = None, generation_config=None, logits_processor=None,
             stopping_criteria=None, prefix_allowed_tokens_fn=None, synced_gpus=None, assistant_model=None,
             streamer=None, negative_prompt_ids=None, negative_prompt_attention_mask=None,
             gamma: Optional[int] = None, **kwargs):
    """What `model.generate(..., custom_generate=<this repo>)` runs. model: the verifier (any causal LM);
    assistant_model: the diffusion drafter; inputs: (1, n) prompt ids. gamma: draft tokens per verifier forward; None:
    `num_assistant_tokens` when the call or its generation config gives it (assisted generation's name for it), else 8.

    The generation config is prepared by generate()'s own steps (model's generation_config, the library's defaults:
    top_k 50, 20 new tokens..., then the arguments), and tokens are chosen through generate()'s own logits processors
    (temperature, top_k, top_p, min_p, typical_p, epsilon/eta cutoffs, repetition_penalty, no_repeat_ngram_size,
    bad_words_ids, min_new_tokens, suppress_tokens, sequence_bias, prefix_allowed_tokens_fn...): greedy output is
    generate()'s token for token, sampled output is distributed as generate()'s. What it cannot reproduce it refuses
    by name (REFUSED, other decoding modes, logits_processor/stopping_criteria lists, streamer).

    Returns (1, n + new) ids like generate(), or with return_dict_in_generate=True a SpecDiffOutput whose `tau` is
    the tokens per verifier forward. One prompt at a time: speculation accepts different lengths per sequence.
    """
    if assistant_model is None:
        raise ValueError("pass the diffusion drafter as assistant_model=")
    # Arbitrary processors and criteria may keep state across calls, and drafts that are then rejected would enter it.
    for name, given in (("logits_processor", logits_processor), ("stopping_criteria", stopping_criteria)):
        if given:
            refuse(f"a {name} list", "applies generate()'s own processors after each draft position's prefix, "
                   "which is exact only for functions of that prefix")
    for name, given in (("streamer", streamer), ("negative_prompt_ids", negative_prompt_ids),
                        ("negative_prompt_attention_mask", negative_prompt_attention_mask)):
        if given is not None:
            refuse(name, "emits accepted blocks at once and runs no guidance")
    if synced_gpus:
        refuse("synced_gpus", "decodes on one process")
    prompt = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if prompt is None or prompt.dim() != 2 or prompt.shape[0] != 1:
        raise ValueError("SpecDiff's custom_generate decodes one prompt at a time: input ids of shape (1, n)")
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(mask.all()):
        raise ValueError("SpecDiff's custom_generate takes an unpadded prompt (attention_mask all ones)")
    kwargs.pop("tokenizer", None)  # generate() reads it for stop strings and token healing only, both refused
    if kwargs.get("assistant_tokenizer") is not None:
        refuse("assistant_tokenizer", "drafts in the verifier's vocabulary")
    kwargs.pop("assistant_tokenizer", None)
    # Assisted generation's draft length, honoured under that name too; its other schedule (a length that grows and
    # shrinks with acceptance) is not this loop's.
    asked = kwargs.get("num_assistant_tokens",
                       getattr(generation_config, "num_assistant_tokens", None) if generation_config else None)
    if gamma is not None and asked is not None and asked != gamma:
        raise ValueError(f"gamma={gamma} and num_assistant_tokens={asked} both set the draft length: give one")
    gamma = gamma if gamma is not None else asked if asked is not None else DEFAULT_GAMMA
    if not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"the draft length (gamma, num_assistant_tokens) is a positive integer, got {gamma!r}")

    # generate()'s own preparation, step by step (transformers/generation/utils.py `generate`, steps 1, 3 and 6):
    # the defaults, the model's generation_config and the arguments merged as there, the end tokens as tensors, and
    # max_length from max_new_tokens or the default of 20 new tokens.
    has_default_max_length = (kwargs.get("max_length") is None
                              and (generation_config is None or generation_config.max_length is None)
                              and model.generation_config.max_length is None)
    has_default_min_length = (kwargs.get("min_length") is None
                              and (generation_config is None or generation_config.min_length is None)
                              and model.generation_config.min_length is None)
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    if model_kwargs:
        raise ValueError(f"SpecDiff's custom_generate takes no model inputs besides input_ids and attention_mask, and "
                         f"{sorted(model_kwargs)} are no generation settings")
    for name, (plain, why) in REFUSED.items():
        value = getattr(config, name, None)
        if value not in plain:
            refuse(f"{name}={value!r}", why)
    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        refuse(f"{mode.value.replace('_', ' ')} (num_beams={config.num_beams}, penalty_alpha={config.penalty_alpha}, "
               f"dola_layers={config.dola_layers})", "decodes greedily or samples, one sequence")
    prompt = prompt.to(model.device)
    n = prompt.shape[1]
    model._prepare_special_tokens(config, mask is not None, device=prompt.device, batch_size=1)
    config = model._prepare_generated_length(config, has_default_max_length, has_default_min_length,
                                             model_input_name="input_ids", input_ids_length=n, inputs_tensor=prompt)
    model._validate_generated_length(config, n, has_default_max_length)
    processors = model._get_logits_processor(generation_config=config, input_ids_seq_length=n,
                                             encoder_input_ids=prompt, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
                                             logits_processor=LogitsProcessorList(), device=prompt.device,
                                             model_kwargs={})
    eos = config.eos_token_id
    eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else list(eos))
    tokens, accept_counts = specdiff(model, Drafter(assistant_model), prompt, gamma, config.max_length - n,
                                     TokenChoice(processors, bool(config.do_sample)), eos_ids)
    sequences = torch.cat([prompt, prompt.new_tensor([tokens])], dim=1)
    if not config.return_dict_in_generate:
        return sequences
    tau = sum(k + 1 for k in accept_counts) / len(accept_counts) if accept_counts else 1.0
    return SpecDiffOutput(sequences=sequences, tau=tau, accept_counts=accept_counts,
                          verifier_forwards=len(accept_counts))
