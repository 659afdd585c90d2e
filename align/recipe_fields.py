"""What recipe sections share: their base class (`Section`: unknown keys refused, partial sub-sections merged into
defaults) and the field types, each with its check: dtypes, method and loss names (with what each loss
reads and how it is normalised), learning rates, trackers, seeds. Torch-free, as the schema (align/config.py, which
re-exports them) is: a recipe is checked before torch is imported.
"""

from __future__ import annotations

from types import UnionType
from typing import Annotated, Any, Literal, NamedTuple, Optional, Union, get_args, get_origin

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo,
                      field_validator, model_validator)

from align.decoding.options import method_name


class Section(BaseModel):
    # extra="forbid": a typo is an error, never a silently ignored key. Numbers given for string fields (e.g. an
    # output folder named 2024) are kept as strings rather than refused. allow_inf_nan=False: YAML reads `.inf` and
    # `.nan` as floats, and no setting here means anything with them (an infinite temperature passed `ge=0`).
    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _merge_with_defaults(cls, data: Any) -> Any:
        # A partial sub-section (`bootstrap.verifier.lr=1e-3`) updates the default instance rather than replacing it,
        # so defaults given as instances (the tiny models' sizes) survive a single-key override.
        if not isinstance(data, dict):
            return data
        merged = dict(data)
        for name, field in cls.model_fields.items():
            if isinstance(field.default, BaseModel) and isinstance(merged.get(name), dict):
                merged[name] = {**field.default.model_dump(), **merged[name]}
        return merged

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic (and Python) read `true` as 1 where a number is wanted: train.max_steps=true trained one step,
        # align.load(gamma=True) drafted one token. A boolean given for a number is a slip, refused.
        annotation = cls.model_fields[info.field_name].annotation if info.field_name else None
        if isinstance(value, bool) and annotation is not None and takes_number(annotation):
            raise ValueError("expects a number, not a boolean")
        spelt = yaml11_numbers(value)
        if spelt and annotation is not None and mentions_number(annotation):
            raise ValueError(spelt[0].why)
        return value


class Yaml11Number(str):
    """A scalar that only YAML 1.1 reads as a number, and as another one than it looks like: `010` (octal: 8; YAML
    1.2 reads 10) and `1:30` (base 60: 90). align's YAML loader keeps its text (recipe_files.StrictLoader), and a
    field that takes a number refuses it; a text field keeps it as written."""

    def __new__(cls, text: str, yaml11_value: Any) -> "Yaml11Number":
        number = super().__new__(cls, text)
        base = "base 60" if ":" in text else "octal"
        number.why = (f"{text} is a number only in YAML 1.1, which reads it as {yaml11_value} ({base}); write "
                      f"{yaml11_value}" + ("" if ":" in text else f" or {int(text.replace('_', ''), 10)}, without the "
                                           "leading zero"))
        return number


def yaml11_numbers(value: Any) -> list[Yaml11Number]:
    """The Yaml11Number scalars in a value, in lists and mappings too."""
    if isinstance(value, Yaml11Number):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for item in value for n in yaml11_numbers(item)]
    if isinstance(value, dict):
        return [n for item in value.values() for n in yaml11_numbers(item)]
    return []


def mentions_number(annotation: Any) -> bool:
    """Whether a field's type takes an int or a float anywhere inside it (list[int], dict[str, float], Optional)."""
    todo, seen = [annotation], set()
    while todo:
        kind = todo.pop()
        if kind in (int, float):
            return True
        if id(kind) not in seen:
            seen.add(id(kind))
            todo.extend(get_args(kind))
    return False


def takes_number(annotation: Any) -> bool:
    """Whether a field's type takes an int or a float and not a bool (Optional and Annotated seen through)."""
    leaves, todo = set(), [annotation]
    while todo:
        kind = todo.pop()
        if get_origin(kind) is Annotated:
            todo.append(get_args(kind)[0])
        elif get_origin(kind) in (Union, UnionType):
            todo.extend(get_args(kind))
        else:
            leaves.add(kind)
    return bool(leaves & {int, float}) and bool not in leaves


# A model's dtype: "device", align's default, bfloat16 on CUDA and float32 on a CPU; "auto", as transformers and vLLM mean
# it, the checkpoint's own (its config.json's dtype); or one named.
Dtype = Literal["device", "auto", "float32", "bfloat16", "float16"]
# The evaluation methods: every option set align/decoding/options.py's grammar allows, by name (align/methods.py's
# METHODS has exactly these keys). A name or a spelling (specdiff+cps+tree) is checked when the recipe loads, before
# torch is imported, and kept as its name.
MethodName = Annotated[str, AfterValidator(method_name)]


class PromptSource(Section):
    """One source of a mixture of training prompts (data.train_prompts as a list), its keys named as
    `datasets.load_dataset`'s arguments and TRL's dataset mixtures name them."""

    #: a local JSONL or Parquet file, a local dataset folder in the Hub layout, or a Hub dataset id (org/name)
    path: str
    #: the dataset config (load_dataset's `name`: GSM8K's main); None: the dataset's only (or default) one
    name: Optional[str] = None
    #: the files of a folder or Hub dataset read (load_dataset's data_files; glob patterns allowed); None: its splits'
    data_files: Optional[list[str]] = Field(default=None, min_length=1)
    #: the revision of a Hub dataset (branch, tag or commit); None: its main branch
    revision: Optional[str] = None
    #: the split read; None: data.train_split
    split: Optional[str] = None
    #: the column holding each prompt; None: data.prompt_column
    prompt_column: Optional[str] = None
    #: this source's share of trajectories.num_prompts, relative to the others' (3 and 1: 75% and 25%)
    weight: float = Field(default=1.0, gt=0)

    @field_validator("data_files", mode="before")
    @classmethod
    def _one_file(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value  # as load_dataset takes one pattern or several


class LossDeclaration(NamedTuple):
    #: what the loss is computed against: "targets" (the verifier's tokens) or "verifier_logits" (its distributions,
    #: online or from stored top-k)
    reads: Literal["targets", "verifier_logits"]
    #: what its sum over a step is divided by: "windows" (a per-window quantity: a streak, a chain) or "tokens" (a
    #: per-position divergence); the loss function takes num_windows or num_tokens accordingly
    normalised_by: Literal["windows", "tokens"]


# The window losses, each declared here once with what it reads and how it is normalised. Torch-free, so that a
# recipe's losses are checked before torch is imported; align/losses.py pairs each name with its function of the same
# name (WINDOW_LOSSES) and refuses to load when one is missing; training reads the rest from here, never a loss's name.
LOSSES: dict[str, LossDeclaration] = {
    **{name: LossDeclaration("targets", "windows") for name in (
        "streak", "ce_streak", "position_decay_ce", "dpace", "positional_ce", "first_error_focal", "chain")},
    "ce": LossDeclaration("targets", "tokens"),
    **{name: LossDeclaration("verifier_logits", "windows") for name in ("streak_tv", "draft_opd")},
    **{name: LossDeclaration("verifier_logits", "tokens") for name in ("fkl", "rkl", "tvd", "jsd")},
}
LOSS_NAMES: tuple[str, ...] = tuple(LOSSES)
LossName = Literal[LOSS_NAMES]  # type: ignore[valid-type]
Device = Literal["auto", "cpu", "cuda"]


def _learning_rate(value: float) -> float:
    # (0, 1] is generous on purpose: useful AdamW rates are 1e-6..1e-2, and Adam's step is about lr per weight
    # whatever the gradient's scale, so a rate above 1 moves every weight by more than its own size at the first step
    # and the run diverges. Such a value is a slip (1e6 for 1e-6), refused before a run burns hours on it.
    if not 0.0 < value <= 1.0:
        raise ValueError("a learning rate must be in (0, 1] (AdamW diverges above 1; typical rates are 1e-6 to 1e-2)")
    return value


LearningRate = Annotated[float, AfterValidator(_learning_rate)]

# The smallest sampling temperature taken (vLLM's _SAMPLING_EPS, below which it decodes greedily): logits ÷ 1e-300
# overflowed to inf, and the sampled run died on "probability tensor contains inf/nan" after the greedy one.
SMALLEST_TEMPERATURE = 1e-5


def _temperature(value: float) -> float:
    if 0.0 < value < SMALLEST_TEMPERATURE:
        raise ValueError(f"a temperature is 0 (greedy) or at least {SMALLEST_TEMPERATURE:g}: logits divided by "
                         f"{value:g} overflow to inf")
    return value


def _positive_temperature(value: float) -> float:
    if value < SMALLEST_TEMPERATURE:
        raise ValueError(f"a drafting temperature is at least {SMALLEST_TEMPERATURE:g} (logits divided by less "
                         "overflow to inf)")
    return value


#: 0 (greedy) or a temperature whose logits ÷ temperature stay finite
Temperature = Annotated[float, AfterValidator(_temperature)]
#: a temperature that must sample (no greedy meaning)
PositiveTemperature = Annotated[float, AfterValidator(_positive_temperature)]

# Experiment trackers by transformers' `report_to` names, declared here only (align/tracking.py serves each with the
# Tracker class of the same name). "all" and "none" mean what they mean there: every installed tracker, no tracker.
TRACKER_NAMES: tuple[str, ...] = ("tensorboard", "wandb", "trackio")
TrackerName = Literal[(*TRACKER_NAMES, "all", "none")]  # type: ignore[valid-type]


def _as_list(value: Any) -> Any:
    # As TrainingArguments.report_to: one name or a list of names; YAML's null is "none".
    if value is None:
        return ["none"]
    return [value] if isinstance(value, str) else value


def _alone(value: list[str]) -> list[str]:
    if len(value) > 1 and {"all", "none"} & set(value):
        raise ValueError("'all' and 'none' stand alone, not in a list with other trackers")
    return list(dict.fromkeys(value))


ReportTo = Annotated[list[TrackerName], BeforeValidator(_as_list), AfterValidator(_alone)]


def _project_name(value: str) -> str:
    # wandb refuses these characters in a project name, and names longer than 128 characters.
    if not 0 < len(value) <= 128 or set(value) & set("/\\#?%:"):
        raise ValueError("a project name has 1 to 128 characters, none of / \\ # ? % :")
    return value


TrackerProject = Annotated[str, AfterValidator(_project_name)]

# A random seed. numpy's legacy seeding (np.random.seed, which transformers' set_seed and vLLM's engine call) takes
# [0, 2**32 - 1] and torch's generators take at most 2**64 - 1, so a seed outside the first range is refused here
# rather than mid-run; seeds derived from it (seed * 1_000_003 + chunk in trajectories and bootstrap, seed * 100_003
# + prompt in decoding) then stay inside torch's.
SEED_MAX = 2**32 - 1


def _seed(value: int) -> int:
    if not 0 <= value <= SEED_MAX:
        raise ValueError(f"a seed is an integer in [0, {SEED_MAX}] (2**32 - 1: numpy's and vLLM's range)")
    return value


Seed = Annotated[int, AfterValidator(_seed)]
