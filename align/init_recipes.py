"""`align init VERIFIER --out FOLDER`: the recipes that align a drafter to your own verifier (a Hub id or a local
folder), shaped from its config and tokenizer: the Magpie prompts it writes itself, a DFlash drafter (which vLLM
serves), a standalone block-diffusion drafter cut from its own layers, and the eval that compares them with the free
options. Every key is commented with its meaning, in the schema's own words (align/config.py's `#:` lines, read by
`recipe_files.key_meanings`), and, where init chose a value for this model, why.

Written as text, not dumped from a Recipe: the comments are the point, and PyYAML drops them. Each file is checked by
the same loader `align <stage>` uses before anything is written; an existing file is never overwritten.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path
from typing import Any, Optional

import yaml

from align.config import RecipeError

FILES = ("prompts.yaml", "dflash.yaml", "diffusion.yaml", "eval.yaml")
WIDTH = 118


GENERIC = ("verifier", "model", "base", "export", "hf")


def slug(verifier: str) -> str:
    """A folder name for the model: `Qwen/Qwen2.5-0.5B-Instruct` -> `qwen2.5-0.5b-instruct`; a local folder by a
    generic name (checkpoints/smollm2/verifier) by its parent's."""
    path = Path(verifier.rstrip("/"))
    name = path.parent.name if path.name.lower() in GENERIC and path.parent.name else path.name
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-.") or "verifier"


def flow(value: Any) -> str:
    """A value as YAML on one line."""
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


class Writer:
    """Lines of one recipe: a section at a time, each key with its schema meaning and init's reason above it."""

    def __init__(self, header: str) -> None:
        self.lines = []
        for line in header.splitlines():  # prose wrapped, commands (indented) kept whole to copy
            wrapped = [line] if line.startswith("  ") else textwrap.wrap(line, WIDTH - 2) or [""]
            self.lines += [f"# {part}".rstrip() for part in wrapped]

    def comment(self, text: str, indent: int) -> None:
        self.lines += textwrap.wrap(text, WIDTH, initial_indent=" " * indent + "# ",
                                    subsequent_indent=" " * indent + "# ")

    def top(self, key: str, value: Any) -> None:
        self.lines.append(f"{key}: {flow(value)}")

    def section(self, name: str, items: list[tuple[str, Any, Optional[str]]]) -> None:
        """items: (key, value, why init chose it or None)."""
        from align.recipe_files import key_meanings, section_class

        kind = section_class(name)
        meanings = key_meanings(kind)
        self.lines.append(f"{name}:")
        for key, value, why in items:
            if key not in kind.model_fields:
                raise AssertionError(f"{name}.{key} is not a recipe key")  # init's own slip: a test catches it
            if key in meanings:
                self.comment(meanings[key], 2)
            if why:
                self.comment(f"align init: {why}", 2)
            self.lines.append(f"  {key}: {flow(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def describe(verifier: str, trust_remote_code: bool) -> dict[str, Any]:
    """What the recipes need to know of the verifier, from its config.json and tokenizer (no weights are read)."""
    from transformers import AutoConfig, AutoTokenizer

    from align.data import chat_template
    from align.drafters.dflash import default_aux_layers
    from align.drafters.mask_token import choose_mask_token
    from align.remote_code import install

    install()  # before the config is read (see preflight.load_model_config)
    try:
        config = AutoConfig.from_pretrained(verifier, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(verifier, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise RecipeError(f"{verifier}: cannot read its config and tokenizer ({str(e).splitlines()[0]}); give a "
                          "local model folder, or a Hub id that is reachable or cached") from None
    text = config.get_text_config()
    layers, vocab = int(text.num_hidden_layers), int(text.vocab_size)
    template = chat_template(tokenizer, "auto", verifier)
    mask_id, mask_why = choose_mask_token(tokenizer, vocab, template)
    dtype = str(getattr(text, "dtype", None) or getattr(config, "torch_dtype", None) or "float32").removeprefix("torch.")
    return dict(layers=layers, vocab=vocab, hidden=int(text.hidden_size), chat=template is not None,
                aux=default_aux_layers(layers), mask_id=mask_id, mask_why=mask_why,
                dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "float32",
                context=int(getattr(text, "max_position_embeddings", 0) or 0), architecture=type(config).__name__,
                local=Path(verifier).is_dir())


def recipes(verifier: str, name: str, model: dict[str, Any]) -> dict[str, str]:
    """file name -> recipe text."""
    ck, data = f"checkpoints/{name}", f"data/{name}"
    hub_id = None if model["local"] else verifier
    hub_why = (None if hub_id else "the verifier is a local folder: set its Hub id here before `align export "
               "--push-to-hub`, or the card and speculators config name a path nobody else has")
    dtype_why = (f"the checkpoint's dtype ({model['dtype']}); on a CPU without native bf16 (no AVX512-BF16 or AMX) "
                 "float32 is several times faster")
    new_tokens = 128 if not model["context"] else max(16, min(128, model["context"] // 4))
    template = "on" if model["chat"] else "off"
    common_data = [
        ("train_prompts", f"{data}/prompts/prompts.jsonl" if model["chat"] else None,
         "the prompts `align prompts` writes (prompts.yaml)" if model["chat"] else
         "the tokenizer has no chat template, so `align prompts` (Magpie) cannot write prompts: name a prompt "
         "dataset here (a JSONL file, a Parquet folder or a Hub dataset id)"),
        ("prompt_column", "messages" if model["chat"] else "prompt", None),
        ("chat_template", template, "the tokenizer has a chat template" if model["chat"] else
         "the tokenizer has no chat template"),
    ]
    trajectories = [
        ("out", f"{data}/trajectories", "one folder for both drafters (every setting below must match)"),
        ("temperature", 0.0, "eval verifies greedily first: the drafters learn the greedy answers (DistillSpec)"),
        ("completions_per_prompt", 1, None),
        ("max_new_tokens", new_tokens, None),
        ("batch_size", 128, None),
        ("backend", "vllm", "vLLM batches continuously (launch/setup_vllm.sh installs its own venv); hf needs none"),
        ("vllm_cpu_kv_cache_gib", 2.0, None),
    ]
    commands = {
        "prompts.yaml": f"align prompts {{dir}}/prompts.yaml",
        "dflash.yaml": "align trajectories {dir}/dflash.yaml\nalign train {dir}/dflash.yaml --num_gpus 2\n"
                       f"align export {{dir}}/dflash.yaml drafter.path=$(align latest {ck}/dflash/train)",
        "diffusion.yaml": f"align derive {{dir}}/diffusion.yaml\nalign train {{dir}}/diffusion.yaml --num_gpus 2\n"
                          f"align export {{dir}}/diffusion.yaml drafter.path=$(align latest {ck}/diffusion/train)",
        "eval.yaml": "align eval {dir}/eval.yaml",
    }
    intro = (f"Written by `align init {verifier}` for {model['architecture']} ({model['layers']} layers, width "
             f"{model['hidden']}, {model['vocab']:,} tokens). Edit freely: every key is checked when a stage "
             "reads it (`align validate <file>` checks it now).\n\nThe whole run, in order (prompts, then both "
             "drafters on the same trajectories, then the eval):\n")

    written = [f for f in FILES if f != "prompts.yaml" or model["chat"]]

    def header(file: str, what: str) -> str:
        order = "\n".join(f"  {line}" for f in written for line in commands[f].split("\n"))
        return f"{what}\n\n{intro}{order}\n\nThis file's commands:\n" + "\n".join(
            f"  {line}" for line in commands[file].split("\n"))

    files: dict[str, str] = {}
    if model["chat"]:
        w = Writer(header("prompts.yaml", "Training prompts the verifier writes itself (Magpie): no dataset is read, "
                          "so no benchmark item can become training data."))
        w.top("name", f"{name}-prompts")
        w.section("verifier", [("path", verifier, None), ("dtype", model["dtype"], dtype_why)])
        w.section("prompts", [
            ("out", f"{data}/prompts", None),
            ("num_prompts", 2560, "about 280k answer tokens at 128 each: drafters are short of data before "
                                  "anything else (issue 37)"),
            ("backend", "vllm", None), ("batch_size", 256, None), ("vllm_cpu_kv_cache_gib", 2.0, None),
            ("max_new_tokens", 160, None),
        ])
        files["prompts.yaml"] = w.text()

    w = Writer(header("dflash.yaml", "A DFlash drafter (target-conditioned block diffusion) for this verifier: "
                      "trained on the verifier's own greedy answers, exported in the speculators format vLLM serves."))
    w.top("name", f"{name}-dflash")
    w.section("verifier", [("path", verifier, None), ("dtype", model["dtype"], dtype_why)])
    w.section("dflash", [
        ("num_layers", 2, "2 fits a CPU or a small GPU budget; DFlash and speculators use 5 on GPUs"),
        ("aux_layer_ids", model["aux"], f"three of the verifier's {model['layers']} layers, spread as DFlash "
                                        "spreads them (None picks the same)"),
        ("draft_vocab_size", 32768 if model["vocab"] > 32768 else None,
         "EAGLE-3's pruned head: the drafter's LM head over the 32,768 tokens the verifier writes most"
         if model["vocab"] > 32768 else "the vocabulary is small enough to draft over whole"),
    ])
    w.section("data", common_data)
    w.section("trajectories", trajectories)
    w.section("train", [
        ("out", f"{ck}/dflash/train", None), ("losses", {"ce_streak": 1.0}, None), ("gamma", 8, None),
        ("windows_per_sequence", 32, "every window of a row shares its one verifier forward"),
        ("max_steps", 1500, "30 minutes on a 2-core CPU for a 135M verifier; far more on a GPU"),
        ("cache_verifier_states", True, None), ("micro_batch_size", 2, None), ("lr", 1.0e-3, None),
        ("warmup_steps", 10, None), ("save_every", 100, None), ("keep_last", 2, None), ("eval_every", 100, None),
        ("bf16", model["dtype"] == "bfloat16", None),
    ])
    w.section("decode", [("gamma", 8, None), ("max_new_tokens", new_tokens, None)])
    w.section("export", [("out", f"{ck}/dflash/export", None), ("format", "speculators", None),
                         ("verifier_hub_id", hub_id, hub_why),
                         ("license", None, "the verifier's licence (e.g. apache-2.0): the drafter is derived data")])
    w.section("serve_check", [("out", f"{ck}/serve-check", None), ("drafter", f"{ck}/dflash/export", None),
                              ("concurrency", [1, 4, 16], None), ("ngram", True, None)])
    files["dflash.yaml"] = w.text()

    w = Writer(header("diffusion.yaml", "A standalone block-diffusion drafter cut from the verifier's own layers "
                      "(align derive), then aligned on the same trajectories."))
    w.top("name", f"{name}-diffusion")
    w.section("verifier", [("path", verifier, None), ("dtype", model["dtype"], dtype_why)])
    w.section("drafter", [("path", f"{ck}/diffusion/base", f"written by align derive; its mask token: "
                                                            f"{model['mask_why']}")])
    w.section("data", common_data)
    w.section("trajectories", trajectories)
    w.section("derive", [("out", f"{ck}/diffusion/base", None),
                         ("num_layers", min(4, model["layers"]), None), ("max_steps", 150, None)])
    w.section("train", [("out", f"{ck}/diffusion/train", None), ("losses", {"dpace": 1.0}, None), ("gamma", 8, None),
                        ("max_steps", 100, None), ("micro_batch_size", 4, None), ("lr", 3.0e-4, None),
                        ("bf16", model["dtype"] == "bfloat16", None)])
    w.section("decode", [("gamma", 8, None), ("max_new_tokens", new_tokens, None),
                         ("suffix_corpus", f"{data}/trajectories", "the export carries SuffixDecoding's index")])
    w.section("export", [("out", f"{ck}/diffusion/export", None), ("verifier_hub_id", hub_id, hub_why),
                         ("license", None, None)])
    files["diffusion.yaml"] = w.text()

    w = Writer(header("eval.yaml", "Every decoding method on one benchmark, interleaved: AR and HF generate, the "
                      "model-free options, and both drafters (the union tree among them)."))
    w.top("name", f"{name}-eval")
    w.section("verifier", [("path", verifier, None), ("dtype", model["dtype"], dtype_why)])
    w.section("drafter", [("path", f"{ck}/diffusion/export", None)])
    w.section("data", [("dir", f"{data}/cache", None), ("chat_template", template, None)])
    w.section("decode", [("gamma", 8, None), ("max_new_tokens", new_tokens, None), ("tree_nodes", 16, None),
                         ("suffix_corpus", f"{data}/trajectories", None)])
    w.section("eval", [
        ("out", f"{ck}/eval", None), ("prompts", "openai/gsm8k", "any prompt dataset: a file, a folder or a Hub id"),
        ("dataset_config", "main", None), ("prompt_column", "question", None), ("split", "test", None),
        ("num_prompts", 30, None),
        ("compare_drafters", {"dflash": f"{ck}/dflash/export"}, "the DFlash drafter's rows beside the standalone's"),
        ("methods", ["ar", "hf_generate", "prompt_lookup", "ngram", "suffix_ngram_cost", "specdiff", "specdiff_tree",
                     "specdiff_ngram_suffix_tree_cost"], None),
        ("sampling_temperature", 1.0, None),
    ])
    files["eval.yaml"] = w.text()
    return files


def init(args: argparse.Namespace) -> int:
    """Write the recipes; 2 with one line on bad input, before anything is written."""
    from align.recipe_files import load_recipe

    out = Path(args.out)
    try:
        if out.exists() and not out.is_dir():
            raise RecipeError(f"--out {out}: a file, not a folder")
        taken = [str(out / f) for f in FILES if (out / f).exists()]
        if taken:
            raise RecipeError(f"--out {out}: {taken[0]} exists; align init never writes over a recipe (choose "
                              "another folder, or move it)")
        name = args.name or slug(args.verifier)
        files = recipes(args.verifier, name, describe(args.verifier, args.trust_remote_code))
    except RecipeError as e:
        print(f"align init: error: {e}", file=sys.stderr)
        return 2
    import tempfile

    from align.disk import write_text_atomic

    files = {file: text.replace("{dir}", str(out)) for file, text in files.items()}
    with tempfile.TemporaryDirectory() as scratch:  # each read as every stage reads it, before any is written
        for file, text in files.items():
            (Path(scratch) / file).write_text(text)
            load_recipe(Path(scratch) / file)  # a slip of init's own fails here, loudly
    out.mkdir(parents=True, exist_ok=True)
    for file, text in files.items():
        write_text_atomic(out / file, text)
    print(f"wrote {', '.join(str(out / f) for f in files)}")
    print(f"next: {'align prompts ' + str(out / 'prompts.yaml') if 'prompts.yaml' in files else 'set data.train_prompts'}"
          f" (each file's header lists the whole run)")
    return 0
