"""A user's DeepSpeed JSON (train.deepspeed_config) checked before any launcher starts (issue 52).

DeepSpeed reads its config lazily, inside the ranks: a key it does not know is ignored without a word, a value of the
wrong type fails at the step that first uses it (`"steps_per_print": "often"` is a TypeError at the first print), and
offload settings the run's ZeRO stage does not run are dropped (the run trains, offloading nothing). So the file is
checked here, in one line naming the dotted key, by DeepSpeed's own rules where DeepSpeed has them: the sections it
parses with a pydantic model of its own (extra keys forbidden, its types and ranges) are validated by that model, of
the installed DeepSpeed; only the keys it reads raw (`get_scalar_param`, no schema) are typed here, by how its code
uses them.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from align.config import RecipeError

# The sections DeepSpeed validates with a pydantic model (module:class, imported when a file is checked).
MODELS = {
    "zero_optimization": "deepspeed.runtime.zero.config:DeepSpeedZeroConfig",
    "bf16": "deepspeed.runtime.precision_config:DeepSpeedBF16Config",
    "fp16": "deepspeed.runtime.precision_config:DeepSpeedFP16Config",
    "comms_logger": "deepspeed.comm.config:CommsLoggerConfig",
    "tensorboard": "deepspeed.monitor.config:TensorBoardConfig",
    "wandb": "deepspeed.monitor.config:WandbConfig",
    "csv_monitor": "deepspeed.monitor.config:CSVConfig",
    "comet": "deepspeed.monitor.config:CometConfig",
    "hybrid_engine": "deepspeed.runtime.config:HybridEngineConfig",
    "compile": "deepspeed.compile.config:CompileConfig",
    "weight_quantization": "deepspeed.inference.config:WeightQuantConfig",
}
# Sections DeepSpeed knows and parses itself, with parsers of several levels this check does not follow: only their
# being an object is checked (DeepSpeed calls .keys() on them).
OPAQUE = {"autotuning", "data_efficiency", "pipeline", "aio", "checkpoint", "timers", "tensor_parallel",
          "expert_parallel", "torch_autocast", "datastates_ckpt"}
# Top-level keys the merge (align/dist.py) owns: derived from the recipe, or refused there.
ALIGNS = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
          "optimizer", "scheduler"}
# Old names DeepSpeed still reads, but under a key align always writes, so DeepSpeed would ignore them.
SHADOWED = {"bfloat16": "'bf16', which align writes from train.bf16 (DeepSpeed reads 'bfloat16' only without it)"}


def _lower(value: Any) -> Any:  # DeepSpeed lower-cases these names before comparing them
    return value.lower() if isinstance(value, str) else value


Precision = Annotated[Optional[Literal["fp16", "bf16", "fp32"]], BeforeValidator(_lower)]
Dtype = Optional[Literal["fp16", "float16", "half", "fp32", "float32", "float", "bf16", "bfloat16", "int8",
                         "torch.float16", "torch.float32", "torch.bfloat16", "torch.int8"]]  # its DtypeEnum's names


class Raw(BaseModel):
    """Keys DeepSpeed reads raw: strict (it converts nothing: a "5" stays a string), unknown keys refused."""
    model_config = ConfigDict(extra="forbid", strict=True)


class ActivationCheckpointing(Raw):  # deepspeed/runtime/activation_checkpointing/config.py
    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: Optional[int] = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


class FlopsProfiler(Raw):  # deepspeed/profiling/config.py
    enabled: bool = False
    recompute_fwd_factor: float = 0.0
    profile_step: int = Field(1, ge=1)
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    output_file: Optional[str] = None


class DataTypes(Raw):  # deepspeed/runtime/config.py, data_types (grad_accum_dtype: align's, checked by the merge)
    grad_accum_dtype: Any = None
    param_dtype: Dtype = None
    buffer_dtype: Dtype = None
    keep_in_fp32_modules: Literal["auto"] | list[str] = "auto"


class TopLevel(Raw):
    """DeepSpeed's raw top-level keys (deepspeed/runtime/config.py, constants.py) and the sections above; the rest
    is allowed through (extra) and checked by name in `check_keys`."""
    model_config = ConfigDict(extra="allow", strict=True)
    steps_per_print: Optional[int] = Field(None, ge=1)  # DeepSpeed takes the step modulo it
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    dump_state: bool = False
    disable_allgather: bool = False
    disable_python_gc: bool = False
    managed_gradient_accumulation: bool = True
    prescale_gradients: bool = False
    gradient_predivide_factor: float = Field(1.0, gt=0)
    gradient_allreduce_op: Annotated[Literal["mean", "sum"], BeforeValidator(_lower)] = "mean"
    communication_data_type: Precision = None
    seq_parallel_communication_data_type: Precision = "fp32"
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    dataloader_drop_last: bool = False
    use_data_before_expert_parallelism: bool = False
    vocabulary_size: Optional[int] = None
    sequence_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int = Field(1, ge=1)
    log_level: Optional[str] = None
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing()
    flops_profiler: FlopsProfiler = FlopsProfiler()
    data_types: DataTypes = DataTypes()


KNOWN = sorted({*MODELS, *OPAQUE, *ALIGNS, *(k for k in TopLevel.model_fields)})


def check_deepspeed_json(given: dict[str, Any], merged: dict[str, Any], path: str) -> None:
    """`given` (the user's file at `path`) and `merged` (it merged under align's derived config, the config DeepSpeed
    will get) as DeepSpeed would read them: RecipeError, one line naming the dotted key and what was expected, for a
    key DeepSpeed does not know, a value of the wrong type or range, or an offload the run's ZeRO stage cannot run."""
    check_keys(given, path)  # names first: a misspelled section's values are never looked at by DeepSpeed
    try:
        TopLevel.model_validate(merged)
    except ValidationError as e:
        raise RecipeError(refusal(path, e, (), TopLevel)) from None
    zero = None
    for section, where in MODELS.items():  # merged: the ZeRO section with align's stage, which its validators read
        if section in merged:
            module, _, name = where.partition(":")
            model = getattr(importlib.import_module(module), name)
            try:
                validated = model(**merged[section])
            except ValidationError as e:
                raise RecipeError(refusal(path, e, (section,), model)) from None
            except (AssertionError, ValueError, TypeError) as e:  # DeepSpeed's own checks of deprecated fields
                raise RecipeError(f"train.deepspeed_config: {path}: {section}: {e}") from None
            zero = validated if section == "zero_optimization" else zero
    if zero is not None:
        check_offload(zero, path)


def check_keys(given: dict[str, Any], path: str) -> None:
    """Every top-level key of the user's file is one DeepSpeed reads, and a section is an object. (Keys inside a
    section are its model's to refuse: `refusal` names them.)"""
    from deepspeed.runtime import config as ds_config

    removed = getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {})  # DeepSpeed refuses these, but in the ranks
    for key, value in given.items():
        if key in removed:
            raise RecipeError(f"train.deepspeed_config: {path}: {key}: this DeepSpeed no longer has it "
                              f"({removed[key].split('. ')[0].rstrip('.')})")
        if key in SHADOWED:
            raise RecipeError(f"train.deepspeed_config: {path}: {key} is DeepSpeed's old name of {SHADOWED[key]}; "
                              "yours would be ignored")
        if key not in KNOWN:
            raise RecipeError(f"train.deepspeed_config: {path}: {unknown(key, KNOWN)}")
        if (key in MODELS or key in OPAQUE) and not isinstance(value, dict):
            raise RecipeError(f"train.deepspeed_config: {path}: {key} is {value!r} (expected an object)")


def unknown(dotted: str, known: list[str]) -> str:
    """`unknown DeepSpeed key 'a.b' (did you mean 'a.c'?)`, as align's recipe errors say it (recipe_files.py)."""
    section, _, name = dotted.rpartition(".")
    close = difflib.get_close_matches(name, known, n=1)
    return f"unknown DeepSpeed key '{dotted}'" + (f" (did you mean '{section + '.' if section else ''}{close[0]}'?)"
                                                  if close else "")


def refusal(path: str, error: ValidationError, at: tuple[str, ...], model: type[BaseModel]) -> str:
    """One line for pydantic's first complaint about the section at `at`: the dotted key, pydantic's words, the
    value (DeepSpeed's own models say what they expect: "Input should be 'none', 'cpu' or 'nvme'")."""
    first = error.errors()[0]
    loc = (*at, *(str(part) for part in first["loc"]))
    dotted = ".".join(loc)
    if first["type"] == "extra_forbidden":
        return f"train.deepspeed_config: {path}: {unknown(dotted, fields_of(model, first['loc'][:-1]))}"
    got = first.get("input")
    shown = "" if isinstance(got, dict) else f" (got {got!r})"
    return f"train.deepspeed_config: {path}: {dotted}: {first['msg'].removeprefix('Value error, ')}{shown}"


def fields_of(model: Any, loc: tuple[Any, ...]) -> list[str]:
    """The keys the model nested at `loc` under `model` takes (its fields and their aliases), for 'did you mean'."""
    for part in loc:
        field = model.model_fields.get(part) or next(
            (f for f in model.model_fields.values() if f.alias == part), None)
        kinds = () if field is None else (field.annotation, *getattr(field.annotation, "__args__", ()))  # Optional[M]
        nested = [kind for kind in kinds if isinstance(kind, type) and issubclass(kind, BaseModel)]
        if not nested:
            return []
        model = nested[0]
    return sorted({*model.model_fields, *(f.alias for f in model.model_fields.values() if f.alias)})


def check_offload(zero: Any, path: str) -> None:
    """Offload settings as DeepSpeed runs them at the merged ZeRO stage (train.zero_stage): parameters offload only
    under ZeRO-3 and the optimizer state only under ZeRO 1-3 (below, DeepSpeed drops the setting and trains without
    offloading); NVMe is ZeRO-Infinity, ZeRO-3 only (stages 1-2 would put the optimizer state in CPU memory instead),
    and it swaps to the folder nvme_path names (without one DeepSpeed fails at its first swap)."""
    stage = int(zero.stage)
    for name, lowest in (("offload_param", 3), ("offload_optimizer", 1)):
        offload = getattr(zero, name)
        device = "none" if offload is None else str(getattr(offload.device, "value", offload.device))
        if device == "none":
            continue
        key = f"train.deepspeed_config: {path}: zero_optimization.{name}"
        if stage < lowest:
            stages, fix = ("ZeRO-3", "3") if lowest == 3 else ("ZeRO stages 1-3", "1, 2 or 3")
            raise RecipeError(f"{key}: DeepSpeed offloads it only under {stages}, and train.zero_stage is {stage} "
                              f"(it would train offloading nothing); set train.zero_stage={fix}, or leave {name} out")
        if device == "nvme" and stage < 3:
            raise RecipeError(f"{key}.device: nvme is ZeRO-Infinity, ZeRO-3 only (at train.zero_stage {stage} "
                              "DeepSpeed keeps the state in CPU memory instead); set train.zero_stage=3 or device cpu")
        if device == "nvme" and offload.nvme_path is None:
            raise RecipeError(f"{key}.nvme_path: required with device nvme (the folder on the NVMe drive DeepSpeed "
                              "swaps to)")
