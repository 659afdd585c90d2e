"""`align <stage> recipe.yaml [key.sub=value ...]`: parse, build the recipe, check inputs, call the stage. No logic.

Everything the user can get wrong is checked here, before a stage loads a model or touches a file: a bad recipe is
refused before torch is imported; the stage's own checks (its module's models, prompts and check, align/stages/) run
after its module is imported. A bad recipe or input is one line on stderr and exit code 2.

Exit codes, and what is said (always one line on stderr, never a traceback):
  0    done
  1    the machine failed the run: a full disk, a quota, a read-only or forbidden output (the line names the path;
       what was already written is intact); also a failed upload (export) and a stage's own runtime failure
  2    bad input: a recipe, a file or a model align cannot use, refused before work, or a damaged file found on
       reading (named)
  3    a stage's check failed: non-finite training (train), outputs or acceptance that differ (serve-check)
  130  interrupted by SIGINT (Ctrl-C); 143 by SIGTERM: every process align started is stopped first
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, NoReturn, Optional, get_args

import yaml

from align.config import Recipe, RecipeError
from align.drafters.spec import VERIFIER_ARCHITECTURES
from align.launch import check_launch, integer_in, single_local_process
from align.preflight import check_inputs, check_models, check_output
from align.recipe_fields import Dtype
from align.recipe_files import get_key, load_recipe
from align.stages import STAGES, Stage

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C (143: SIGTERM)


def show_latest(args: argparse.Namespace) -> int:
    from align.checkpoint import latest_step

    found = latest_step(args.run)
    if found is None:
        print(f"align latest: error: no step_<N> checkpoint under {args.run}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(found)
    return 0


def show_build_ops(args: argparse.Namespace) -> int:
    from align.dist import build_deepspeed_ops

    built = build_deepspeed_ops()
    print(f"align build-ops: {built}" if built else "align build-ops: this accelerator has no DeepSpeed op to build")
    return 0


def show_throughput(args: argparse.Namespace) -> int:
    from align.bench import throughput_table
    from align.checkpoint import latest_step

    runs = [Path(run) for run in args.runs]
    for run in runs:
        if not (run / "metrics.jsonl").is_file() or latest_step(run) is None:
            print(f"align throughput: error: {run} is not a finished align train run folder", file=sys.stderr)
            return EXIT_BAD_INPUT
    print(throughput_table(runs, args.warmup_steps))
    return 0


def show_exact(args: argparse.Namespace) -> int:
    """Exit 1 unless every temperature-0 method of every eval.json matched its reference token for token."""
    from align.preflight import read_eval

    try:  # every file read and checked before any line is printed: a bad one is a refusal, not a half report
        evaluations = {path: read_eval(path, "align exact", ("exact_match",)) for path in args.evals}
    except RecipeError as e:
        print(f"align exact: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    failed = 0
    for path, evaluation in evaluations.items():
        for name, m in evaluation["methods"].items():
            print(f"{path}: {name}: exact_match {m['exact_match']:.2f}")
            failed += m["exact_match"] != 1.0
    print("every greedy output identical to its reference" if not failed else f"{failed} methods differ")
    return 1 if failed else 0


def show_verify_costs(args: argparse.Namespace) -> int:
    """Print (and with --out write) each model's verifier cost curve on this machine."""
    import json

    import torch

    from align.bench import model_configs, verify_cost_curves
    from align.disk import check_output_file
    from align.models import DTYPES
    from align.preflight import context_length

    def refuse(message: str) -> int:
        print(f"align verify-costs: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT

    try:
        configs = model_configs(args.models)  # every name checked before any model is built
    except ValueError as error:
        return refuse(str(error))
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        device = None
    if device is None or (device.type == "cuda" and not torch.cuda.is_available()):
        return refuse(f"--device {args.device}: not a device this machine has")
    # Everything the benchmark could fail on at its end is checked before it starts (minutes on a 7B model).
    for name, config in configs.items():
        try:
            longest = context_length(config)
        except RecipeError:
            continue  # no stated limit: the forward itself will say
        if args.context + args.max_tokens > longest:
            return refuse(f"--context {args.context} + --max-tokens {args.max_tokens} exceeds {name}'s context of "
                          f"{longest} tokens")
    if args.out:
        try:
            check_output_file("--out", args.out, "models")
        except RecipeError as e:
            return refuse(str(e))
    dtype = DTYPES[args.dtype]
    report = verify_cost_curves(configs, args.context, args.max_tokens, dtype, device, args.rounds)
    for name, curve in report["models"].items():
        costs, shown = curve["verify_s"], [n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n <= args.max_tokens]
        print(f"{name} ({curve['parameters'] / 1e6:,.0f} M parameters, {args.dtype}, {device}) ms at n = "
              + ", ".join(f"{n}: {costs[n - 1] * 1e3:.2f}" for n in shown)
              + f"; n = {shown[-1]} costs {costs[shown[-1] - 1] / costs[0]:.2f}× n = 1")
    if args.out:
        from align.disk import write_text_atomic

        write_text_atomic(Path(args.out), json.dumps(report, indent=2))
    return 0


def _tool_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    if name == "latest":
        parser.add_argument("run", help="an align train run folder (train.out)")
    elif name == "exact":
        parser.add_argument("evals", nargs="+", help="eval.json files")
    elif name == "verify-costs":
        parser.add_argument("models", nargs="+", help=f"{', '.join(VERIFIER_ARCHITECTURES)}, or folders / Hub ids "
                            "with a config.json (random weights: none are downloaded)")
        parser.add_argument("--context", type=integer_in(1), default=512, help="cached tokens before each forward")
        parser.add_argument("--max-tokens", type=integer_in(1), default=64, help="the largest forward, in new tokens")
        parser.add_argument("--dtype", choices=[d for d in get_args(Dtype) if d not in ("auto", "device")],
                            default="bfloat16")
        parser.add_argument("--device", default=None, help="default: cuda where there is a GPU, else cpu")
        parser.add_argument("--rounds", type=integer_in(1), default=7,
                            help="interleaved rounds; each size's median is kept")
        parser.add_argument("--out", help="write the curves (and the machine) as JSON here")
    elif name == "build-ops":
        pass
    elif name == "init":
        parser.add_argument("verifier", help="the verifier: a local model folder or a Hub id (org/name)")
        parser.add_argument("--out", required=True, help="folder for the recipes (e.g. recipes/mine); never "
                            "written over")
        parser.add_argument("--name", default=None, help="the folder name under checkpoints/ and data/ (default: "
                            "from the verifier's name)")
        parser.add_argument("--trust-remote-code", action="store_true", help="the verifier ships its own code")
    else:
        parser.add_argument("runs", nargs="+", help="align train run folders")
        parser.add_argument("--warmup-steps", type=integer_in(0), default=5, help="first steps left out of the median")


# Commands without a recipe, for scripts: what stages wrote, read back; and a benchmark of this machine.
# name -> (help, function of the parsed arguments).
def init_recipes(args: argparse.Namespace) -> int:
    from align.init_recipes import init

    return init(args)


TOOLS: dict[str, tuple[str, Callable[[argparse.Namespace], int]]] = {
    "init": ("write the recipes for your own verifier (prompts, DFlash and standalone drafters, eval), shaped from "
             "its config and tokenizer and commented key by key", init_recipes),
    "latest": ("print the newest step_<N> checkpoint folder of a training run", show_latest),
    "throughput": ("print a table of training tokens/s (median after warm-up) for training run folders",
                   show_throughput),
    "exact": ("check that every greedy output in eval.json files equals its reference (AR greedy, or vanilla "
              "dLLM decoding); exit 1 if one differs", show_exact),
    "build-ops": ("build DeepSpeed's CPU communication op now (about a minute, once per machine; launch/setup.sh "
                  "runs it), rather than inside a first run's ranks, where a build stopped half-way leaves a lock "
                  "that every later run waits on", show_build_ops),
    "verify-costs": ("a benchmark: a verifier's cost curve on this machine (one cached forward over 1..N new tokens, "
                     "random weights in its architecture), which sizes drafts and trees", show_verify_costs),
}


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line like every other refusal (its default prints the usage first), and a
    stage's recipe sections (`sections`) listed under its --help, built only when the help is shown: reading the
    meanings of every key out of config.py's source took 0.77 s, which every command paid before doing anything."""

    sections: tuple[str, ...] = ()

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)

    def format_help(self) -> str:
        if self.sections and self.epilog is None:
            self.epilog = _section_help(self.sections)
        return super().format_help()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("align-drafters")  # the distribution name; the import name is align
    except PackageNotFoundError:  # run from a checkout that was never installed
        from align import __version__

        return __version__


def _section_help(sections: tuple[str, ...]) -> str:
    import textwrap

    from align.recipe_files import key_meanings, section_class

    defaults = Recipe().to_dict()
    lines = ["recipe sections (key: default, then what it means: the schema's own words, align/config.py):"]
    for name in sections:
        section, kind = defaults[name], section_class(name)
        if section is None:  # an optional section (dflash): off until one of its keys is set; these are its defaults
            section = kind().model_dump(mode="json")
            name_shown = f"{name} (unset)"
        else:
            name_shown = name
        meanings = key_meanings(kind)
        lines.append(f"  {name_shown}:")
        for key, value in section.items():
            shown = "{...}" if isinstance(value, dict) and len(str(value)) > 60 else value
            lines.append(f"    {name}.{key}: {shown}")
            if key in meanings:
                lines += textwrap.wrap(meanings[key], 112, initial_indent=" " * 8, subsequent_indent=" " * 8)
    return "\n".join(lines)


def _stage_arguments(parser: argparse.ArgumentParser, stage: Stage) -> None:
    parser.add_argument("recipe", help="recipe YAML file")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="recipe overrides, validated as the YAML is")
    if stage.launcher:
        from align.launch import add_launcher_arguments

        add_launcher_arguments(parser)
    if stage.module is None:  # validate
        parser.add_argument("--get", metavar="KEY", default=None,
                            help="print only the resolved value of KEY (e.g. train.out), for scripts")
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
        p = sub.add_parser(name, help=stage.help, description=stage.help,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.sections = stage.sections
        _stage_arguments(p, stage)
        stage_parsers[name] = p
    for name, (text, _) in TOOLS.items():
        _tool_arguments(name, sub.add_parser(name, help=text, description=text))
    return parser, stage_parsers


def main(argv: Optional[list[str]] = None) -> int:
    import signal

    from align.disk import EXIT_DISK_FAULT, disk_fault
    from align.launch import handle_interrupts, interrupt_signal, stop_children, strip_launcher_args

    if argv is None:  # the `align` command itself (tests call main with arguments, in pytest's own process)
        handle_interrupts()
    argv = strip_launcher_args(sys.argv[1:] if argv is None else argv)
    name = f"align {argv[0]}" if argv and (argv[0] in STAGES or argv[0] in TOOLS) else "align"
    try:
        return _run(argv)
    except KeyboardInterrupt as interrupt:
        # Ctrl-C (or SIGTERM) is the user's choice, not a failure: no traceback. The processes align started are
        # stopped before it says so; whatever was written is whole (atomic writes, tolerant logs).
        stopped, signum = stop_children(), interrupt_signal(interrupt)
        how = "" if signum == signal.SIGINT else f" by {signal.Signals(signum).name}"
        # A child's progress bar may have left its line unfinished: the one line starts on a line of its own.
        print(("\n" if stopped else "") + f"{name}: interrupted{how}" +
              ("; every process it started is stopped" if stopped else ""), file=sys.stderr)
        return 128 + signum  # EXIT_INTERRUPTED for SIGINT, 143 for SIGTERM
    except RecipeError as e:  # a damaged file found by a tool (the stages' own are said in _run)
        print(f"{name}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as error:  # a full disk, a quota, a read-only or forbidden output: one line naming the path
        line = disk_fault(error)
        if line is None:
            raise
        stop_children()
        print(f"{name}: error: {line}", file=sys.stderr)
        return EXIT_DISK_FAULT


def _nothing(recipe: Recipe) -> tuple:
    return ()


def check_stage(stage: Stage, recipe: Recipe) -> None:
    """Everything the stage will read or write, checked before it starts: the files and folders its table entry names,
    then what its module declares (models, prompts, its own check; align/stages/__init__.py). Raises RecipeError."""
    check_inputs(recipe, file_keys=stage.file_keys)
    module = importlib.import_module(stage.module) if stage.module is not None else None
    check_models(recipe, getattr(module, "models", _nothing)(recipe))
    from align.disk import check_output_owner

    written = {key: Path(str(get_key(recipe, key))) for key in (*stage.outputs, *stage.folders)}
    for key, folder in written.items():
        check_output(key, str(folder), writable=key in stage.outputs)
        # Its recipe section is the kind of output a folder holds (data.dir: data, serve_check.out: serve_check).
        check_output_owner(key, folder, key.split(".")[0], replaced=key in stage.replaces)
    same = [(a, b) for i, a in enumerate(written) for b in list(written)[i + 1:]
            if written[a].resolve() == written[b].resolve()]
    if same:
        a, b = same[0]
        raise RecipeError(f"{b}: {written[b]} is also {a}; each of a stage's outputs needs a folder of its own")
    # After the outputs: reading the tiny prompts builds data.dir on first use.
    for key, model_key in getattr(module, "prompts", _nothing)(recipe):
        from align.data import check_prompts  # reads datasets and tokenizers: only for the stages that need them

        check_prompts(recipe, key, model_key)
    getattr(module, "check", _nothing)(recipe)


def hold_outputs(stage: Stage, recipe: Recipe, args: argparse.Namespace) -> ExitStack:
    """The locks of the stage's output folders (RecipeError when another run holds one), held until the returned
    stack closes. Ranks spread over hosts by a launcher lock for themselves (rank 0), since they cannot see this
    process's locks."""
    from align.disk import folder_lock

    held = ExitStack()
    if stage.launcher and not (args.hostfile is None and args.num_nodes in (None, 1)):
        return held
    try:
        for key in stage.outputs:
            held.enter_context(folder_lock(key, str(get_key(recipe, key))))
    except BaseException:
        held.close()
        raise
    return held


def _run(argv: list[str]) -> int:
    parser, stage_parsers = build_parser()
    if argv and argv[0] in TOOLS:
        args = parser.parse_args(argv)
        return TOOLS[argv[0]][1](args)
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
        if stage.launcher and not single_local_process(args):
            check_launch(args)  # the flags passed to DeepSpeed's runner, before a folder is held or a process starts
        held = hold_outputs(stage, recipe, args) if stage.module is not None else ExitStack()
    except RecipeError as e:
        if int(os.environ.get("RANK", 0)) == 0:  # under a launcher (deepspeed align/train.py), each rank would say it
            print(f"align {args.stage}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    with held:
        return _start(stage, recipe, args, argv)


def _start(stage: Stage, recipe: Recipe, args: argparse.Namespace, argv: list[str]) -> int:
    if stage.module is None:
        if args.get is not None:
            try:
                value = get_key(recipe, args.get)
            except RecipeError as e:
                print(f"align {args.stage}: error: {e}", file=sys.stderr)
                return EXIT_BAD_INPUT
            print(value if isinstance(value, (str, int, float, bool)) or value is None else
                  yaml.safe_dump(value, default_flow_style=True).strip())
            return 0
        print(yaml.safe_dump(recipe.to_dict(), sort_keys=False), end="")
        return 0
    if stage.launcher:
        from align.launch import launch_world, run, single_local_process

        if not single_local_process(args):
            # Checks that need the launch's number of ranks, said here once: a rank that refuses ends the launch,
            # and the launcher may stop rank 0 before it says why
            check = getattr(importlib.import_module(stage.module), "check_launch", None)
            world = launch_world(args)
            try:
                if check is not None and world is not None:
                    check(recipe, world)
            except RecipeError as e:
                print(f"align {args.stage}: error: {e}", file=sys.stderr)
                return EXIT_BAD_INPUT
            return run(args)
    try:
        status = importlib.import_module(stage.module).main(recipe, shlex.join(["align", *argv]))
    except RecipeError as e:  # a problem only the stage can see (e.g. a model's spec); still before any writing
        if int(os.environ.get("RANK", 0)) == 0:  # launched on several ranks, each would say the same
            print(f"align {args.stage}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return status or 0


if __name__ == "__main__":
    raise SystemExit(main())
