"""Compatibility shims for remote modelling code written for transformers 4 (Dream and DiffuCoder, LLaDA), as the Hub
ships it, under the pinned transformers 5.

transformers loads a model's own code (`trust_remote_code`) through `dynamic_module_utils.get_class_in_module`;
`install` wraps that function once so that every class it hands out (to `from_pretrained`, `from_config`,
`AutoConfig`, and so to a `type(model)(config)` rebuilt later from the same module) has been through the shims
below. Each shim bridges one named transformers change, looks for the defect itself (the class or module as written),
and leaves code without it alone, so a fixed upstream file passes through untouched. What a shim changed is recorded
in the class's or module's `__align_shims__` (`shims_applied` reads it).

A defect no shim can bridge is reported instead: LLaDA's attention drops every mask (`attn_mask=None` hard-coded, so
`attention_bias` and the 2-D padding `attention_mask` are ignored). `honours_attention_masks` finds that by its
behaviour, and align's loader records it on the model (`MASKS_IGNORED`) for the code that would send one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

SHIMS_ATTRIBUTE = "__align_shims__"
# Set (True) by align's loader on a drafter whose forward ignores attention masks (see `honours_attention_masks`).
MASKS_IGNORED = "align_ignores_attention_masks"


def _record(target: Any, name: str) -> None:
    done = target.__dict__.get(SHIMS_ATTRIBUTE) if isinstance(target, type) else getattr(target, SHIMS_ATTRIBUTE, None)
    if done is None:
        done = set()
        setattr(target, SHIMS_ATTRIBUTE, done)
    done.add(name)


def _is_remote(obj: Any) -> bool:
    return getattr(obj, "__module__", "").startswith("transformers_modules.")


# --------------------------------------------------------------------------------------------------------------------
# the shims
# --------------------------------------------------------------------------------------------------------------------
def default_rope_parameters(config: Any, device: Any = None, seq_len: Any = None, **rope_kwargs: Any
                            ) -> tuple[torch.Tensor, float]:
    """transformers 4's `_compute_default_rope_parameters`: plain RoPE inverse frequencies, attention factor 1.

    The base comes from `rope_theta` (transformers 5 configs keep it in `rope_parameters`); the dimension from
    `head_dim`, else hidden_size / num_attention_heads, times `partial_rotary_factor`. transformers 4's BC keywords
    (`base`, `dim`, passed when a module is built without a config) win over the config, as they did there."""
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    base = rope_kwargs.get("base") or getattr(config, "rope_theta", None) or rope_parameters.get("rope_theta")
    dim = rope_kwargs.get("dim")
    if dim is None:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
    return inv_freq, 1.0


def shim_rope_default(module: ModuleType) -> bool:
    """transformers 5 dropped "default" from `modeling_rope_utils.ROPE_INIT_FUNCTIONS` (each model now computes plain
    RoPE itself, `compute_default_rope_parameters`). Dream's `DreamRotaryEmbedding` still looks up
    `ROPE_INIT_FUNCTIONS["default"]` (KeyError: 'default' on every build). The module gets its own copy of the table
    with transformers 4's default added back; transformers' table is left as it is."""
    table = module.__dict__.get("ROPE_INIT_FUNCTIONS")
    if not isinstance(table, dict) or "default" in table:
        return False
    module.ROPE_INIT_FUNCTIONS = {**table, "default": default_rope_parameters}
    _record(module, "rope_default")
    return True


def shim_generation_config_validate(cls: type) -> bool:
    """transformers 5's `GenerationConfig.__init__` and `update` call `self.validate(user_set_attributes=...)`.
    Dream's `DreamGenerationConfig.validate(self, is_init=False)` takes no such keyword (TypeError when the model's
    generation config is built, in Dream's own `from_pretrained`). The override accepts and ignores what it does not
    know; what it does know is passed on."""
    from transformers import GenerationConfig

    validate = cls.__dict__.get("validate")
    if not (issubclass(cls, GenerationConfig) and callable(validate)) or _accepts(validate, "user_set_attributes"):
        return False
    known = set(inspect.signature(validate).parameters) - {"self"}

    @functools.wraps(validate)
    def validate_any(self: Any, *args: Any, **kwargs: Any) -> Any:
        return validate(self, *args, **{k: v for k, v in kwargs.items() if k in known})

    cls.validate = validate_any
    _record(cls, "generation_config_validate")
    return True


def shim_post_init(cls: type) -> bool:
    """transformers 5's `from_pretrained` reads `all_tied_weights_keys` (and other static properties) that
    `PreTrainedModel.post_init` sets. LLaDA's `LLaDAModelLM.__init__` never calls `post_init` (AttributeError:
    'LLaDAModelLM' object has no attribute 'all_tied_weights_keys'). The wrapped `__init__` calls it when the class's
    own did not; post_init sets properties only, it does not touch the weights."""
    from transformers import PreTrainedModel

    init = cls.__dict__.get("__init__")
    if not (issubclass(cls, PreTrainedModel) and callable(init)) or "post_init" in _attributes_used(init):
        return False

    @functools.wraps(init)
    def init_then_post_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        # (not `type(self) is cls`: transformers 5 builds a same-named subclass of the class it loads)
        if "all_tied_weights_keys" not in self.__dict__:
            self.post_init()

    cls.__init__ = init_then_post_init
    _record(cls, "post_init")
    return True


def shim_tie_weights(cls: type) -> bool:
    """transformers 5 calls `model.tie_weights(recompute_mapping=False)` after building a model and
    `tie_weights(missing_keys=..., recompute_mapping=False)` while loading one. LLaDA's own `tie_weights(self)` takes
    neither (TypeError: unexpected keyword argument). The override accepts them and runs the model's own tying
    (`weight_tying`: ff_out is wte)."""
    tie = cls.__dict__.get("tie_weights")
    if not callable(tie) or (_accepts(tie, "missing_keys") and _accepts(tie, "recompute_mapping")):
        return False

    @functools.wraps(tie)
    def tie_weights(self: Any, *args: Any, **kwargs: Any) -> Any:
        return tie(self)

    cls.tie_weights = tie_weights
    _record(cls, "tie_weights")
    return True


def shim_config_use_cache(cls: type) -> bool:
    """transformers 4's `PretrainedConfig.__init__` kept `use_cache` from its keyword arguments; transformers 5's
    drops it (only models that declare it keep it). LLaDA's `LLaDAConfig.__init__(use_cache=False, **kwargs)` hands
    it to the base class, so its configs have no `use_cache` and every `LLaDAModelLM.forward` fails on
    `self.config.use_cache`. The wrapped `__init__` sets the value the class was given (or its default) when the
    base class dropped it."""
    from transformers import PretrainedConfig

    init = cls.__dict__.get("__init__")
    if not (issubclass(cls, PretrainedConfig) and callable(init)):
        return False
    if "use_cache" not in inspect.signature(init).parameters or "use_cache" in _attributes_used(init):
        return False  # Dream's config sets `self.use_cache` itself
    signature = inspect.signature(init)

    @functools.wraps(init)
    def init_keeping_use_cache(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if "use_cache" not in self.__dict__:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            self.use_cache = bound.arguments["use_cache"]

    cls.__init__ = init_keeping_use_cache
    _record(cls, "config_use_cache")
    return True


CLASS_SHIMS: tuple[Callable[[type], bool], ...] = (shim_generation_config_validate, shim_post_init, shim_tie_weights,
                                                   shim_config_use_cache)
MODULE_SHIMS: tuple[Callable[[ModuleType], bool], ...] = (shim_rope_default,)


def _attributes_used(function: Callable) -> tuple[str, ...]:
    """The global and attribute names `function`'s own code reads or sets (its code object's names: not comments)."""
    return getattr(getattr(function, "__code__", None), "co_names", ())


def _accepts(function: Callable, keyword: str) -> bool:
    parameters = inspect.signature(function).parameters
    return keyword in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


# --------------------------------------------------------------------------------------------------------------------
# applying them
# --------------------------------------------------------------------------------------------------------------------
def apply_shims(cls: type) -> type:
    """Run every shim over the remote module that defines `cls` and over the remote modules it imports from (Dream's
    modelling module takes its generation config class from generation_utils), once per class and module."""
    module = sys.modules.get(cls.__module__)
    if module is None or not _is_remote(cls):
        return cls
    modules = {module.__name__: module}
    for value in list(vars(module).values()):
        home = sys.modules.get(getattr(value, "__module__", ""))
        if home is not None and _is_remote(value):
            modules[home.__name__] = home
    for remote in modules.values():
        # transformers re-executes a module in place when its files change (a new `__transformers_module_hash__`),
        # making new classes: those are shimmed again
        version = remote.__dict__.get("__transformers_module_hash__", True)
        if remote.__dict__.get("__align_shimmed__") == version:
            continue
        for shim in MODULE_SHIMS:
            shim(remote)
        for value in list(vars(remote).values()):
            if isinstance(value, type) and value.__module__ == remote.__name__:
                for shim in CLASS_SHIMS:
                    shim(value)
        remote.__align_shimmed__ = version
    return cls


def install() -> None:
    """Route every class transformers loads from a model's own code through `apply_shims` (idempotent)."""
    from transformers import dynamic_module_utils

    current = dynamic_module_utils.get_class_in_module
    if getattr(current, "__align_shims__", False):
        return

    @functools.wraps(current)
    def get_class_in_module(*args: Any, **kwargs: Any) -> type:
        return apply_shims(current(*args, **kwargs))

    get_class_in_module.__align_shims__ = True
    dynamic_module_utils.get_class_in_module = get_class_in_module


def shims_applied(model_or_class: Any) -> set[str]:
    """The names of the shims that changed `model_or_class`'s class, its config's class, or their modules."""
    classes = [model_or_class if isinstance(model_or_class, type) else type(model_or_class)]
    config = getattr(model_or_class, "config", None)
    if config is not None:
        classes.append(type(config))
    names: set[str] = set()
    for cls in classes:
        for klass in cls.__mro__:
            names |= set(klass.__dict__.get(SHIMS_ATTRIBUTE, ()))
            module = sys.modules.get(klass.__module__)
            names |= set(getattr(module, SHIMS_ATTRIBUTE, ()))
            for value in vars(module).values() if module is not None and _is_remote(klass) else ():
                if isinstance(value, type) and _is_remote(value):
                    names |= set(value.__dict__.get(SHIMS_ATTRIBUTE, ()))
    return names


# --------------------------------------------------------------------------------------------------------------------
# masks the model drops
# --------------------------------------------------------------------------------------------------------------------
def masks_ignored(model: Any) -> bool:
    """Whether align's loader found that `model` (through a peft or DeepSpeed wrapper) ignores attention masks."""
    for _ in range(4):
        if getattr(model, "__dict__", {}).get(MASKS_IGNORED, False):
            return True
        model = model.get_base_model() if hasattr(model, "get_base_model") else getattr(model, "module", None)
        if model is None:
            return False
    return False


@torch.no_grad()
def honours_attention_masks(model: Any, mask_kwargs: Callable[[Any, torch.Tensor], dict[str, torch.Tensor]],
                            vocab: int) -> bool:
    """Whether `model`'s forward reads the 4-D additive mask (1, 1, 4, 4) that `mask_kwargs(model, mask)` hands it:
    the logits at the last of 4 distinct tokens must change when the mask hides the other three from it (causal and
    bidirectional models alike see them without it). Both forwards run in eval mode (dropout would tell them apart)
    and without gradients; the model's mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return _changes_under_mask(model, mask_kwargs, vocab)
    finally:
        model.train(was_training)


def _changes_under_mask(model: Any, mask_kwargs: Callable[[Any, torch.Tensor], dict[str, torch.Tensor]],
                        vocab: int) -> bool:
    # Weights, or buffers for a model that holds no parameter (a lookup table)
    tensors = [*model.parameters(), *model.buffers()]
    device = tensors[0].device
    ids = torch.linspace(0, vocab - 1, 4, device=device).long()[None]  # any 4 distinct tokens
    dtype = next(t.dtype for t in tensors if t.is_floating_point())
    allowed = torch.ones(4, 4, dtype=torch.bool, device=device)
    allowed[3, :3] = False  # the last position sees itself only
    hiding = torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)[None, None]
    with_mask = model(input_ids=ids, **mask_kwargs(model, hiding)).logits[0, 3].float()
    without = model(input_ids=ids, **mask_kwargs(model, torch.zeros_like(hiding))).logits[0, 3].float()
    return not torch.equal(with_mask, without)


def restore_computed_buffers(model: Any) -> None:
    """Recompute the non-persistent buffers of remote code written for transformers 4.

    transformers 5 builds a model on the meta device and fills what the checkpoint holds and what the model's
    `_init_weights` sets; a non-persistent buffer that the code computes in `__init__` (Dream's and DiffuCoder's rotary
    `inv_freq`) is left as uninitialised memory, and the model silently reads garbage positions. A skeleton built with
    its parameters on the meta device (no memory) and its buffers on the CPU gives the values `__init__` computes."""
    computed = dict(model.named_non_persistent_buffers())
    if not computed:
        return
    try:
        from accelerate import init_empty_weights

        building = init_empty_weights(include_buffers=False)
    except ImportError:  # an exported folder read with transformers alone, without accelerate: built whole, once
        building = contextlib.nullcontext()
    with building:
        skeleton = type(model)(model.config)
    for name, value in skeleton.named_non_persistent_buffers():
        if name in computed:
            module_name, _, leaf = name.rpartition(".")
            old = computed[name]
            model.get_submodule(module_name).register_buffer(leaf, value.to(old.device, old.dtype), persistent=False)


def restores_on_load(cls: type) -> bool:
    """Whether `cls.from_pretrained` already ends with `restore_computed_buffers` (an exported folder's loader wrapped
    it: restoring_computed_buffers)."""
    return getattr(getattr(cls.__dict__.get("from_pretrained"), "__func__", None), "__align_restores__", False)


def restoring_computed_buffers(cls: type) -> type:
    """`cls` (a remote PreTrainedModel class), whose `from_pretrained` now ends with `restore_computed_buffers`: what
    align's loader does after loading, for a folder read with transformers alone (`write_loader`)."""
    if restores_on_load(cls):
        return cls
    loading = cls.__dict__.get("from_pretrained")  # Dream's own override, else the one it inherits

    def from_pretrained(klass: type, *args: Any, **kwargs: Any) -> Any:
        load = loading.__get__(None, klass) if loading is not None else super(cls, klass).from_pretrained
        model = load(*args, **kwargs)
        restore_computed_buffers(model)
        return model

    from_pretrained.__align_restores__ = True
    cls.from_pretrained = classmethod(from_pretrained)
    return cls


# --------------------------------------------------------------------------------------------------------------------
# an exported folder that loads with transformers alone
# --------------------------------------------------------------------------------------------------------------------
SHIMS_MODULE, LOADER_MODULE = "align_shims", "align_loader"


def write_loader(folder: Path, auto_map: dict[str, str]) -> dict[str, str]:
    """Make the model folder `folder`, whose config.json's `auto_map` names its own modelling code, load under
    transformers 5 with transformers alone: this module is copied in as `align_shims.py` (it imports torch and the
    standard library only) and `align_loader.py` imports each class `auto_map` names, through `apply_shims`. Returns
    the `auto_map` to write, every local entry pointing at the loader. The upstream files are left as they are.

    A folder already written this way (an export exported again) keeps its loader and gets this version's shims."""
    folder = Path(folder)
    header = (f"# Copied from align/remote_code.py by `align export`: the shims {LOADER_MODULE}.py applies to this "
              "folder's modelling code (written for transformers 4) so that transformers 5 loads it.\n")
    (folder / f"{SHIMS_MODULE}.py").write_text(header + Path(__file__).read_text())
    if any(ref.startswith(f"{LOADER_MODULE}.") for ref in auto_map.values()):
        return auto_map
    local = {auto: ref for auto, ref in auto_map.items() if "--" not in ref}  # "repo--module.Class": another repo's
    lines = ['"""Written by `align export`. config.json\'s auto_map loads each class through here: this folder\'s own',
             "modelling code was written for transformers 4, and align's shims (align_shims.py) bridge each change",
             'transformers 5 made that it meets, as align does when it loads the model. The upstream files are as they',
             'were shipped."""', "", f"from .{SHIMS_MODULE} import apply_shims, restoring_computed_buffers"]
    for ref in sorted(set(local.values())):
        module, name = ref.rsplit(".", 1)
        lines.append(f"from .{module} import {name}")
    lines.append("")
    for auto, ref in sorted(local.items()):
        name = ref.rsplit(".", 1)[1]
        # a model class also gets back, after loading, the buffers its __init__ computes (restore_computed_buffers)
        wrap = "restoring_computed_buffers(apply_shims({}))" if auto != "AutoConfig" else "apply_shims({})"
        line = f"{name} = " + wrap.format(name)
        if line not in lines:
            lines.append(line)
    (folder / f"{LOADER_MODULE}.py").write_text("\n".join(lines) + "\n")
    return {auto: f"{LOADER_MODULE}.{ref.rsplit('.', 1)[1]}" if auto in local else ref
            for auto, ref in auto_map.items()}
