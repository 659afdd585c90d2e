"""The DrafterSpec (how to read a diffusion drafter: align/drafters/loading.py says why each field matters), the model
families align knows and the methods each drafter kind runs. Plain Python, without torch, so that a drafter is
checked from its config before any weights load (align/preflight.py, the CLI).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, Optional

from align.config import RecipeError
from align.decoding.options import METHOD_NAMES, parse_method

Attention = Literal["bidirectional", "block_causal"]
ATTENTION_MODES: tuple[str, ...] = ("bidirectional", "block_causal")

# How a noised (not yet decoded) position is filled when the drafter reads it:
# - "mask": with the mask token (LLaDA, Dream, DiffuCoder, the tiny drafter: they were trained that way);
# - "uniform": with a token drawn uniformly from the vocabulary (DiffusionGemma: its generate() starts every canvas
#   from torch.randint and renoises rejected positions the same way; it has no mask token). align keeps
#   `mask_token_id` as its own marker of a noised position everywhere (runtime, Spiffy, windows) and swaps in the
#   family's fill only where the model reads the block (align/drafters/noise.py `noise_fill`).
NOISE_KINDS: tuple[str, ...] = ("mask", "uniform")

# Verifiers drafters are paired with: name -> (model_type, the sizes of their Hub config.json), written out so that
# `align verify-costs` measures their cost curves offline (a GPU machine without the Hub, say).
VERIFIER_ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-1.5b": ("qwen2", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2.5-7b": ("qwen2", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4)),
    "llama-3.1-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8)),
}

# Hub dLLM families whose configs do not carry a drafter_spec: model_type -> (logits_shift, attention).
KNOWN_DLLMS: dict[str, tuple[int, str]] = {
    "llada": (0, "bidirectional"),
    "dream": (1, "bidirectional"),  # Dream and DiffuCoder are adapted from Qwen2.5, hence shifted
    # Native in transformers: a causal encoder writes the context cache (exact, grows as tokens are accepted), a
    # bidirectional decoder reads it and denoises the canvas; canvas position i predicts token i, so unshifted.
    "diffusion_gemma": (0, "block_causal"),
}
# Known families whose noise is not the mask token (the others are "mask").
KNOWN_DLLM_NOISE: dict[str, str] = {"diffusion_gemma": "uniform"}
# Families whose causal encoder (context cache) and bidirectional decoder (canvas) are two modules sharing one set of
# weights (DiffusionGemma).
CANVAS_DECODER_FAMILIES: frozenset[str] = frozenset({"diffusion_gemma"})
SPEC_FIELDS: tuple[str, ...] = ("mask_token_id", "logits_shift", "attention")
# standalone: a diffusion LM reading the context tokens (SpecDiff-2); dflash: a block-diffusion drafter conditioned on
# the verifier's hidden states, sharing its embeddings and LM head (align/drafters/dflash.py)
DRAFTER_KINDS: tuple[str, ...] = ("standalone", "dflash")
# The methods each kind cannot run: the one table, read by `align eval`'s check (from the drafter's config), the
# runtime's adapters (Drafter.refused_methods) and the Python API. A DFlash drafter drafts one block per pass: several
# candidates from one pass (self-selection) would need the block batched over its context K/V (not done yet); a
# draft tree needs one block (the accepted path's verifier states join the drafter's context).
REFUSED_METHODS: dict[str, tuple[str, ...]] = {
    "standalone": (),
    "dflash": tuple(name for name in METHOD_NAMES if "select" in parse_method(name)),
}
KIND_NAMES: dict[str, str] = {"standalone": "standalone diffusion", "dflash": "DFlash"}


def kind_methods(kind: str) -> tuple[str, ...]:
    """The methods that decode with a diffusion drafter of `kind` (those of the specdiff family it does not refuse)."""
    return tuple(name for name in METHOD_NAMES
                 if parse_method(name).base == "specdiff" and name not in REFUSED_METHODS[kind])


def method_refusal(kind: str, method: str, drafter: str) -> Optional[str]:
    """Why `method` (a method name, or `name@label` for eval.compare_drafters) cannot run a drafter of `kind` at
    `drafter`, as the end of a one-line refusal that names the method first; None when it can."""
    if method.split("@", 1)[0] not in REFUSED_METHODS[kind]:
        return None
    return f"does not run a {KIND_NAMES[kind]} drafter ({drafter}); its methods are {', '.join(kind_methods(kind))}"


@dataclass(frozen=True)
class DrafterSpec:
    mask_token_id: int  # with noise "uniform": align's marker of a noised position, never shown to the model
    logits_shift: int
    attention: str
    noise: str = "mask"  # NOISE_KINDS: what the model reads at a noised position
    noise_seed: int = 0  # noise "uniform": the seed of the fixed draw that fills noised positions (noise_fill)
    kind: str = "standalone"  # DRAFTER_KINDS

    def __post_init__(self) -> None:
        if self.noise not in NOISE_KINDS:
            raise ValueError(f"noise must be one of {NOISE_KINDS}, got {self.noise!r}")
        if self.kind not in DRAFTER_KINDS:
            raise ValueError(f"kind must be one of {DRAFTER_KINDS}, got {self.kind!r}")
        if self.logits_shift not in (0, 1):
            raise ValueError(f"logits_shift must be 0 or 1, got {self.logits_shift}")
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {self.attention!r}")
        if self.mask_token_id < 0:
            raise ValueError(f"mask_token_id must be >= 0, got {self.mask_token_id}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _stored_spec(config: Any, tokenizer: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """What is known of a spec: explicit overrides > `config.drafter_spec` > known dLLM families > the tokenizer."""
    stored = dict(getattr(config, "drafter_spec", None) or {})
    model_type = str(getattr(config, "model_type", "")).lower()
    known = KNOWN_DLLMS.get(model_type)
    if known is not None:
        stored.setdefault("logits_shift", known[0])
        stored.setdefault("attention", known[1])
    if model_type in KNOWN_DLLM_NOISE:
        stored.setdefault("noise", KNOWN_DLLM_NOISE[model_type])
    if getattr(config, "mask_token_id", None) is not None:
        stored.setdefault("mask_token_id", config.mask_token_id)
    if tokenizer is not None and getattr(tokenizer, "mask_token_id", None) is not None:
        stored.setdefault("mask_token_id", tokenizer.mask_token_id)
    stored.update({k: v for k, v in overrides.items() if v is not None})
    return stored


def drafter_spec_from_config(
    config: Any,
    tokenizer: Any = None,
    mask_token_id: Optional[int] = None,
    logits_shift: Optional[int] = None,
    attention: Optional[str] = None,
) -> DrafterSpec:
    """Resolve a DrafterSpec: explicit arguments > `config.drafter_spec` > known dLLM families > the tokenizer."""
    stored = _stored_spec(config, tokenizer, dict(mask_token_id=mask_token_id, logits_shift=logits_shift,
                                                  attention=attention))
    missing = [k for k in SPEC_FIELDS if k not in stored]
    if missing:
        raise RecipeError(
            f"drafter: cannot tell its {', '.join(missing)} (no drafter_spec in config.json); "
            f"set {', '.join('drafter.' + k for k in missing)} in the recipe"
        )
    try:
        return DrafterSpec(int(stored["mask_token_id"]), int(stored["logits_shift"]), str(stored["attention"]),
                           str(stored.get("noise", "mask")), int(stored.get("noise_seed", 0)),
                           str(stored.get("kind", "standalone")))
    except (TypeError, ValueError) as e:  # a hand-edited drafter_spec in config.json
        raise RecipeError(f"drafter: invalid drafter_spec {stored} ({e})") from None
