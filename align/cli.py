"""`align <stage> recipe.yaml [key.sub=value ...]`: parse, build the recipe, check inputs, call the stage. No logic.

Everything the user can get wrong is checked here, before a stage imports torch or touches a file: a bad recipe or
input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from dataclasses import dataclass
from typing import Callable, NoReturn, Optional

import yaml

from align.config import (Recipe, RecipeError, check_inputs, check_models, check_output, eval_models, get_key,
                          load_recipe)

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C


def _none(recipe: Recipe) -> tuple[str, ...]:
    return ()


def _train_models(recipe: Recipe) -> tuple[str, ...]:
    # As align/train.py decides: the verifier is loaded for online labels (KD losses, on-policy) and the final eval.
    t = recipe.train
    online = t.data_mode == "on_policy" or (t.data_mode == "online" and any(
        name not in ("streak", "ce_streak") for name in t.losses))
    return ("drafter.path", *(("verifier.path",) if online or t.final_eval_prompts else ()))


@dataclass(frozen=True)
class Stage:
    help: str
    #: module with main(recipe, command); None for stages handled here
    module: Optional[str]
    #: recipe sections the stage reads (shown in its --help)
    sections: tuple[str, ...]
    #: the model keys the stage loads, given the recipe (verifier.path, drafter.path, ar_drafter.path,
    #: eval.compare_drafters.<label>): all go through config.check_models before the stage starts
    models: Callable[[Recipe], tuple[str, ...]] = _none
    #: recipe keys naming files that must exist (when set)
    file_keys: tuple[str, ...] = ()
    #: recipe keys naming folders the stage writes: each must be a folder, or creatable, and writable
    outputs: tuple[str, ...] = ()
    #: folders the stage writes only when something is missing (data.dir: the tiny data, built on first use): only a
    #: file in their way is refused, since a complete one may well be read-only
    folders: tuple[str, ...] = ()
    #: takes the DeepSpeed launcher's options (train, trajectories)
    launcher: bool = False
    #: command-line flags that are sugar for recipe overrides: flag -> recipe key
    flags: tuple[tuple[str, str], ...] = ()


STAGES: dict[str, Stage] = {
    "bootstrap": Stage(
        "build the tiny embedded family (corpus, prompts, tokenizer, verifier, drafter-base, ar-drafter)",
        "align.bootstrap", ("bootstrap", "data"), outputs=("bootstrap.out", "data.dir"),
    ),
    "trajectories": Stage(
        "sample verifier completions of training prompts into checksummed Arrow chunks (resumable, multi-rank)",
        "align.trajectories", ("verifier", "trajectories", "data"), models=lambda r: ("verifier.path",),
        file_keys=("data.train_prompts",), outputs=("trajectories.out",), folders=("data.dir",), launcher=True,
    ),
    "train": Stage(
        "align the drafter to the verifier on trajectories under DeepSpeed (runs align/train.py)",
        "align.train", ("drafter", "verifier", "trajectories", "train"), models=_train_models,
        outputs=("train.out",), launcher=True,
    ),
    "gkd": Stage(
        "DistillSpec baseline: distil the AR drafter from the verifier on the trajectories with TRL's GKD trainer",
        "align.gkd", ("verifier", "ar_drafter", "trajectories", "gkd"),
        models=lambda r: ("verifier.path", "ar_drafter.path"), outputs=("gkd.out",),
    ),
    "calibrate": Stage(
        "calibrate a Spiffy draft graph for the drafter decoded as a diffusion LM, from 20-50 prompts",
        "align.calibrate", ("drafter", "calibrate", "decode", "data"),
        models=lambda r: ("drafter.path",), file_keys=("calibrate.prompts",), outputs=("calibrate.out",),
        folders=("data.dir",),
    ),
    "eval": Stage(
        "compare decoding methods (AR, HF baselines, SD-AR, SpecDiff, self-selection, CPS, ADL) on prompts",
        "align.evaluate", ("verifier", "drafter", "ar_drafter", "decode", "eval", "calibrate", "data"),
        models=eval_models, file_keys=("eval.prompts", "calibrate.graph"), outputs=("eval.out",),
        folders=("data.dir",),
    ),
    "export": Stage(
        "write a Hub-ready folder (weights, DrafterSpec, tokenizer, draft graph, eval, model card); --push-to-hub",
        "align.export", ("drafter", "verifier", "calibrate", "export"),
        models=lambda r: ("drafter.path",), file_keys=("calibrate.graph", "export.eval"), outputs=("export.out",),
        flags=(("--push-to-hub", "export.push_to_hub"), ("--revision", "export.revision"),
               ("--commit-message", "export.commit_message")),
    ),
    "validate": Stage(
        "check a recipe and its overrides, and print it with every default filled in",
        None, tuple(name for name in Recipe.model_fields if name != "name"),
    ),
}


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line like every other refusal (its default prints the usage first)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("align")
    except PackageNotFoundError:  # run from a checkout that was never installed
        from align import __version__

        return __version__


def _section_help(sections: tuple[str, ...]) -> str:
    defaults = Recipe().to_dict()
    lines = ["recipe sections (key: default):"]
    for name in sections:
        lines.append(f"  {name}:")
        for key, value in defaults[name].items():
            shown = "{...}" if isinstance(value, dict) and len(str(value)) > 60 else value
            lines.append(f"    {name}.{key}: {shown}")
    return "\n".join(lines)


def _stage_arguments(parser: argparse.ArgumentParser, stage: Stage) -> None:
    parser.add_argument("recipe", help="recipe YAML file")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="recipe overrides, validated as the YAML is")
    if stage.launcher:
        from align.launch import add_launcher_arguments

        add_launcher_arguments(parser)
    for flag, key in stage.flags:
        parser.add_argument(flag, dest=key, default=None, metavar="VALUE", help=f"same as {key}=VALUE")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser (stages and help) and each stage's own parser."""
    parser = _Parser(
        prog="align",
        description="Align discrete-diffusion drafters to autoregressive verifiers for speculative decoding.",
        epilog="Each stage takes a recipe (recipes/*.yaml) and key.sub=value overrides, e.g.\n"
               "  align bootstrap recipes/tiny/bootstrap.yaml bootstrap.verifier.budget_minutes=5",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"align {_version()}")
    sub = parser.add_subparsers(dest="stage", metavar="<stage>", title="stages", parser_class=_Parser)
    sub.required = True
    stage_parsers = {}
    for name, stage in STAGES.items():
        p = sub.add_parser(name, help=stage.help, description=stage.help, epilog=_section_help(stage.sections),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        _stage_arguments(p, stage)
        stage_parsers[name] = p
    return parser, stage_parsers


def strip_launcher_args(argv: list[str]) -> list[str]:
    """The DeepSpeed launcher appends --local_rank=N to the script's arguments; ranks are read from the environment."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--local_rank":
            skip = True
        elif not arg.startswith("--local_rank="):
            out.append(arg)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    argv = strip_launcher_args(sys.argv[1:] if argv is None else argv)
    try:
        return _run(argv)
    except KeyboardInterrupt:
        # Ctrl-C is the user's choice, not a failure: no traceback. Whatever was written is whole (atomic writes).
        name = f"align {argv[0]}" if argv and argv[0] in STAGES else "align"
        print(f"{name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def check_stage(stage: Stage, recipe: Recipe) -> None:
    """Everything the stage will read or write, checked before it starts. Raises RecipeError."""
    check_inputs(recipe, file_keys=stage.file_keys)
    check_models(recipe, stage.models(recipe))
    for key in stage.outputs:
        check_output(key, str(get_key(recipe, key)))
    for key in stage.folders:
        check_output(key, str(get_key(recipe, key)), writable=False)


def _run(argv: list[str]) -> int:
    parser, stage_parsers = build_parser()
    if not argv or argv[0] not in STAGES:
        parser.parse_args(argv)  # help, version, or argparse's own error for an unknown stage (exit 2)
    if len(argv) == 1:  # said here: intermixed parsing would also name the optional overrides as required
        stage_parsers[argv[0]].error("the following arguments are required: recipe")
    # Per stage, options may come between overrides (`align train r.yaml a=1 --num_gpus 2 b=2`).
    args = stage_parsers[argv[0]].parse_intermixed_args(argv[1:])
    args.stage = argv[0]
    stage = STAGES[args.stage]
    overrides = list(args.overrides) + [f"{key}={getattr(args, key)}" for _, key in stage.flags
                                        if getattr(args, key) is not None]
    try:
        recipe = load_recipe(args.recipe, overrides)
        check_stage(stage, recipe)
    except RecipeError as e:
        print(f"align {args.stage}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if stage.module is None:
        print(yaml.safe_dump(recipe.to_dict(), sort_keys=False), end="")
        return 0
    if stage.launcher:
        from align.launch import run, single_local_process

        if not single_local_process(args):
            return run(args)
        if args.stage == "train":  # the DeepSpeed script's own entry point: it reads the recipe and returns a status
            from align.train import main as train_main

            return train_main([args.recipe, *args.overrides])
    try:
        importlib.import_module(stage.module).main(recipe, shlex.join(["align", *argv]))
    except RecipeError as e:  # a problem only the stage can see (e.g. a model's spec); still before any writing
        print(f"align {args.stage}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
