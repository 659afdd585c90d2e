"""The model layer: devices and dtypes, tokenizers, and loading a model from a folder or a Hub id (the verifier, the AR
drafter; diffusion drafters load through align/drafters/loading.py, which reads their DrafterSpec), ZeRO-3 partitioned
loading, vocabulary sizes and the rollback KV cache. Attention masks are align/masks.py's; what a drafter reads at a
noised position is align/drafters/noise.py's.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
from typing import Any, Iterator, Optional

import torch
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer,
                          DynamicCache)
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from align.checkpoint import adapter_base, is_adapter_folder, merge_adapter
from align.config import ModelSection, RecipeError
from align.disk import hashes_inputs, verify_checksums
# Remote code written for transformers 4 (Dream, DiffuCoder, LLaDA) goes through named compatibility shims as it loads.
from align.remote_code import install as install_remote_code_shims
from align.remote_code import restore_computed_buffers, restores_on_load

install_remote_code_shims()

# --------------------------------------------------------------------------------------------------------------------
# devices, dtypes
# --------------------------------------------------------------------------------------------------------------------
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """The device a model goes to. CUDA means this rank's GPU, cuda:LOCAL_RANK (a bare "cuda" is whatever device is
    current, GPU 0 unless set: every rank of `align trajectories --num_gpus 8` would stack its model there)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RecipeError("device: cuda was asked for, but no CUDA device is visible (use device=auto or cpu)")
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, path: Optional[str] = None, trust_remote_code: bool = False
                  ) -> torch.dtype:
    """The torch dtype of a model's `dtype` setting: "device" (align's default) is bfloat16 on CUDA and float32 on a
    CPU, where batch-1 decoding is no faster in bf16 and fp32 keeps greedy checks exact; "auto" is the checkpoint's own
    (config.json's dtype, as transformers' and vLLM's "auto"; float32 where it names none) of the model at `path`."""
    if name == "device":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "auto":
        if path is None:
            raise ValueError('dtype "auto" is the checkpoint\'s: resolve_dtype needs the model\'s path')
        from align.drafters.speculators_format import speculators_dflash_config, speculators_type

        # a speculators folder's config.json has no transformers model_type: AutoConfig cannot read it
        config = (speculators_dflash_config(path) if speculators_type(path) == "dflash" else
                  AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))
        saved = getattr(config, "dtype", None)
        saved = DTYPES.get(saved, saved) if isinstance(saved, str) else saved
        return saved if saved in DTYPES.values() else torch.float32
    return DTYPES[name]


# --------------------------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------------------------
def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def _load(section: ModelSection, **config_overrides: Any) -> PreTrainedModel:
    if os.path.isdir(section.path):  # a folder align wrote is read only if its files match their checksums
        if hashes_inputs():  # (already done, and cached, where cli checked the models; once a machine under a launcher)
            verify_checksums(section.path)
        if is_adapter_folder(section.path):
            # A LoRA step_<N>/ of align train: its base drafter (checked unchanged), with the adapter merged in memory.
            base = _load(section.model_copy(update={"path": adapter_base(section.path)}), **config_overrides)
            return merge_adapter(base, section.path)
    device = resolve_device(section.device)
    # What loading found missing, unexpected or reshaped (check_loaded), and such a tensor reported, not raised as a
    # traceback. Not for remote code: Dream's own from_pretrained sets attributes on what the base class returns,
    # which is then a tuple.
    checked = {} if section.trust_remote_code else dict(ignore_mismatched_sizes=True, output_loading_info=True)
    kwargs = dict(
        dtype=resolve_dtype(section.dtype, device, section.path, section.trust_remote_code),
        trust_remote_code=section.trust_remote_code,
        **checked,
        **_attention_kwargs(section, config_overrides.get("config")),
        **config_overrides,
    )
    with quiet_loading_report() if checked else contextlib.nullcontext():
        try:
            model = AutoModelForCausalLM.from_pretrained(section.path, **kwargs)
        except ValueError:
            try:
                # DiffusionGemmaForBlockDiffusion is registered under AutoModelForImageTextToText only (AutoModel
                # would build DiffusionGemmaModel, without its LM head).
                model = AutoModelForImageTextToText.from_pretrained(section.path, **kwargs)
            except ValueError:
                # LLaDA and Dream register their LM under AutoModel only.
                model = AutoModel.from_pretrained(section.path, **kwargs)
    if checked:
        model, loading = model
        check_loaded(section.path, loading, without_layers=config_overrides.get("num_hidden_layers") == 0)
    if section.trust_remote_code and not restores_on_load(type(model)):  # (an export's loader did it already)
        restore_computed_buffers(model)
    model.to(device).eval()
    # On the device: a GPU scans a 62 GB verifier in seconds, where one CPU thread (OMP_NUM_THREADS=1 under the
    # launcher) takes minutes
    check_finite(section.path, model)
    model.requires_grad_(False)
    return model


@contextlib.contextmanager
def quiet_loading_report() -> Iterator[None]:
    """transformers' loading report (a table of missing, unexpected and reshaped weights) left unprinted: check_loaded
    reads the same lists and refuses in one line."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


# A decoder layer's tensor in a checkpoint (model.layers.N., language_model.layers.N., ...): what a model loaded with
# no decoder layers (load_verifier_ends) leaves in the checkpoint on purpose.
_LAYER_TENSOR = re.compile(r"(^|\.)layers\.\d+\.")


def check_loaded(path: str, loading: dict[str, list[Any]], without_layers: bool = False) -> None:
    """RecipeError unless every weight the model's config.json describes came from the checkpoint, in its shape, and
    every checkpoint tensor found its place. transformers starts a missing or reshaped weight from random values with
    a warning, and drops a tensor it has no place for: a config.json edited after saving (config.json is outside
    sha256.json, so that a user may change generation settings) then gives a model that runs and is silently wrong."""
    where = f"{path}: config.json does not describe the weights beside it (edited after they were saved?)"
    if loading.get("mismatched_keys"):
        name, saved, built = sorted(loading["mismatched_keys"])[0][:3]
        raise RecipeError(f"{where}: {name} is {tuple(saved)} in the checkpoint, {tuple(built)} by config.json "
                          f"({len(loading['mismatched_keys'])} tensors differ)")
    for key, what in (("missing_keys", "has no tensor in the checkpoint"),
                      ("unexpected_keys", "is in the checkpoint but not in the model config.json describes")):
        names = sorted(loading.get(key) or ())
        if without_layers and key == "unexpected_keys":
            names = [name for name in names if not _LAYER_TENSOR.search(name)]
        if names:
            raise RecipeError(f"{where}: {names[0]} {what} ({len(names)} such tensors)")


def check_finite(path: str, model: PreTrainedModel) -> None:
    """RecipeError naming the file and tensor when a loaded weight is NaN or infinite: such a model decodes greedily
    (argmax of NaN is an index) and fails only once something samples from it, after the greedy work is done."""
    weights = [p for p in model.parameters() if p.is_floating_point()]
    if not weights or bool(torch.stack([torch.isfinite(p).all() for p in weights]).all()):  # one sync, not one each
        return
    from align.disk import non_finite_weights

    found = non_finite_weights(path) if os.path.isdir(path) else None
    raise RecipeError(f"{found or path} holds NaN or infinite weights; a model with them decodes nothing meaningful")


def _attention_kwargs(section: ModelSection, config: Any = None) -> dict[str, str]:
    """`attn_implementation` for transformers to honour, unless the model is remote code that does not declare it:
    LLaDA calls scaled_dot_product_attention itself and never tells transformers, which then refuses "sdpa"."""
    if section.attn_implementation == "sdpa" and section.trust_remote_code:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        config = config or AutoConfig.from_pretrained(section.path, trust_remote_code=True)
        auto_map = getattr(config, "auto_map", None) or {}
        reference = auto_map.get("AutoModelForCausalLM") or auto_map.get("AutoModel")
        if reference and not getattr(get_class_from_dynamic_module(reference, section.path), "_supports_sdpa", False):
            return {}
    return {"attn_implementation": section.attn_implementation}


def load_verifier(section: ModelSection) -> PreTrainedModel:
    """The frozen AR verifier, in eval mode."""
    return _load(section)


def load_verifier_ends(section: ModelSection) -> PreTrainedModel:
    """The verifier's embeddings, final norm and LM head, in its own classes (Gemma's scaled embedding, a tied or untied
    head) and dtype, with none of its decoder layers (transformers builds it with num_hidden_layers=0 and reads only
    those tensors): what a DFlash drafter shares with the verifier when its hidden states were precomputed
    (states.out). SmolLM2-135M: 28M of its 135M parameters; Qwen2.5-7B: 1.1B of 7.6B."""
    return _load(section, num_hidden_layers=0)


def load_ar_drafter(section: ModelSection) -> PreTrainedModel:
    return _load(section)


@contextlib.contextmanager
def partitioned_loading(deepspeed_config: Optional[dict[str, Any]]) -> Iterator[None]:
    """While inside, under a ZeRO-3 DeepSpeed config, each parameter `from_pretrained` builds is partitioned across
    the ranks as it is created and filled from the checkpoint one tensor at a time (transformers' `deepspeed.zero.Init`
    path, switched on while an HfDeepSpeedConfig object lives: it keeps a weak reference only): no rank holds the
    whole model, on its device or in host memory. The drafter's loading only: a frozen verifier runs outside the
    engine and must be whole. A no-op for None or another stage."""
    if not deepspeed_config or deepspeed_config["zero_optimization"]["stage"] != 3:
        yield
        return
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    switch = HfDeepSpeedConfig(deepspeed_config)
    try:
        yield
    finally:
        del switch
        unset_hf_deepspeed_config()


def is_partitioned(model: Any) -> bool:
    """Whether `model`'s parameters are ZeRO-3 partitions (DeepSpeed marks each with `ds_id`; `.data` is then empty
    between forwards and the full shape is `ds_shape`)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def vocab_size(model: PreTrainedModel) -> int:
    if model.get_output_embeddings() is None:  # a DFlash drafter has no LM head of its own: it uses the verifier's
        return int(model.config.vocab_size)
    weight = model.get_output_embeddings().weight
    return getattr(weight, "ds_shape", weight.shape)[0]  # a ZeRO-3 partition's own shape is empty


def config_vocab_size(model: PreTrainedModel) -> int:
    """The vocabulary the model's config declares (on its text part for multimodal configs): unlike the output
    embeddings' shape, it is known under ZeRO-3, which partitions the weights away between forwards."""
    return int(model.config.get_text_config().vocab_size)


def forward_parameters(model: Any) -> set[str]:
    """The keyword arguments `model`'s forward takes (through a peft wrapper): remote code takes other ones."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # through a peft wrapper
    return set(inspect.signature(base.forward).parameters)


# --------------------------------------------------------------------------------------------------------------------
# caches
# --------------------------------------------------------------------------------------------------------------------


def rollback_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty KV cache for `model` that speculative decoding can crop back after a rejection. Sliding-window layers
    (Gemma, Mistral-style) otherwise drop what falls out of the window, and refuse to crop once it is full."""
    with torch.device(model.device):  # sliding layers make a tensor of their window size at construction
        cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    return cache
