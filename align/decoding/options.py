"""Decoding method names, parsed into options. Imports nothing heavy: the recipe schema checks names with it before
torch is imported.

    method := base ("+" option)*          e.g. specdiff, specdiff+cps+tree+cost, sd_ar, ngram+cost, suffix+ngram
    base   := ar | hf_generate | hf_assisted | prompt_lookup | ngram | suffix | sd_ar | specdiff
    option := cps | adl | ngram | suffix | tree | cost | select
              (specdiff's, each at most once, in any order; ngram takes cost, suffix takes ngram and cost)

cps: DiffuSpec's causal-consistency path search ranks the draft (a path, or a tree's nodes); adl: DiffuSpec's adaptive
draft length; ngram, suffix (on a tree): the n-gram continuation of the context, SuffixDecoding's tree over the
verifier's trajectories, join the drafter's tree, all verified in one forward; tree: a draft tree instead of a path;
cost: the cost-aware draft size (a path's length, a tree's node budget); select: SpecDiff-2 self-selection, K candidate
paths verified together. The bases ngram and suffix draft with no model: the tokens after the most recent earlier match
of the context's last few tokens (ngram.py), and the tree of what followed the context's longest suffix in the
verifier's trajectories (suffix.py). An option set's name (eval.json rows, `METHODS`' keys) is its options joined by "_"
in the order above (`specdiff_cps_tree_cost`), except self-selection's, `specdiff2_select`, after its paper; every name
parses too, as an alias of its options.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

BASES = ("ar", "hf_generate", "hf_assisted", "prompt_lookup", "ngram", "suffix", "sd_ar", "specdiff")
OPTIONS = ("cps", "adl", "ngram", "suffix", "tree", "cost", "select")  # in the order names spell them
# The options a base other than specdiff takes.
BASE_OPTIONS = {"ngram": ("cost",), "suffix": ("ngram", "cost")}
# Names that are not their options joined by "_".
NAMED = {("specdiff", ("select",)): "specdiff2_select"}


@dataclass(frozen=True)
class MethodOptions:
    """A decoding method: its base and, for specdiff, the options on it (in OPTIONS order)."""

    base: str
    options: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The name eval.json rows and METHODS use: `specdiff_cps_tree_cost`, `specdiff2_select`."""
        return NAMED.get((self.base, self.options), "_".join((self.base, *self.options)))

    @property
    def spelled(self) -> str:
        """The grammar's spelling: `specdiff+cps+tree+cost`."""
        return "+".join((self.base, *self.options))

    def __contains__(self, option: str) -> bool:
        """`"cps" in method`: whether the option is on."""
        return option in self.options


def conflict(base: str, options: tuple[str, ...]) -> Optional[str]:
    """Why `options` cannot go on `base` (None: they can)."""
    if base != "specdiff" and not set(options) <= set(BASE_OPTIONS.get(base, ())):
        takes = BASE_OPTIONS.get(base)
        return (f"{base} takes only {', '.join(takes)}" if takes else f"{base} takes no options") + \
            f" (specdiff takes {', '.join(OPTIONS)})"
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        return f"unknown option {unknown[0]!r} (specdiff's are {', '.join(OPTIONS)})"
    if len(set(options)) < len(options):
        return "an option named twice"
    if "select" in options and len(options) > 1:
        return "select (self-selection's K candidate paths) takes no other option"
    if "adl" in options and "tree" in options:
        return "adl adapts a path's length; a tree's size is tree_nodes (or cost)"
    if "adl" in options and "cost" in options:
        return "adl and cost both choose the draft length: one of them"
    if base == "specdiff" and "ngram" in options and "tree" not in options:
        return "ngram joins the n-gram continuation to the drafter's tree: it needs tree"
    if base == "specdiff" and "suffix" in options and "tree" not in options:
        return "suffix joins SuffixDecoding's candidates to the drafter's tree: it needs tree"
    return None


def _every_method() -> dict[str, MethodOptions]:
    """Every valid option set by name: the bases, then specdiff's option sets by how many options they hold."""
    found = [MethodOptions(base) for base in BASES]
    for base, options in BASE_OPTIONS.items():
        found += [MethodOptions(base, chosen) for size in range(1, len(options) + 1)
                  for chosen in itertools.combinations(options, size)]
    for size in range(1, len(OPTIONS) + 1):
        found += [MethodOptions("specdiff", chosen) for chosen in itertools.combinations(OPTIONS, size)
                  if conflict("specdiff", chosen) is None]
    return {method.name: method for method in found}


BY_NAME = _every_method()
METHOD_NAMES: tuple[str, ...] = tuple(BY_NAME)


def parse_method(text: str) -> MethodOptions:
    """A method name (`specdiff_cps_tree`) or spelling (`specdiff+tree+cps`) -> its options. Raises ValueError, one
    line naming the methods."""
    if text in BY_NAME:
        return BY_NAME[text]
    base, *options = text.split("+")
    problem = f"unknown base {base!r}" if base not in BASES else conflict(base, tuple(options))
    if problem is None:
        return MethodOptions(base, tuple(o for o in OPTIONS if o in options))
    raise ValueError(f"method {text!r}: {problem}; the methods are {', '.join(METHOD_NAMES)} (or base+options "
                     "spelled like specdiff+cps+tree+cost)")


def method_name(text: str) -> str:
    """A method name or spelling -> its name (what a recipe's eval.methods and the API keep). Raises ValueError."""
    return parse_method(text).name


# The models each evaluation method decodes with besides the verifier (the eval stage checks and loads them).
METHOD_MODELS: dict[str, tuple[str, ...]] = {
    "sd_ar": ("ar_drafter.path",), "hf_assisted": ("ar_drafter.path",),
    **{name: ("drafter.path",) for name in METHOD_NAMES if name.startswith("specdiff")},
}
