"""align trajectories -> the offline dataset `speculators`' trainer reads (`speculators train --data-path DIR`).

speculators 0.9.0 trains a DFlash drafter on (speculators/train/data.py, ArrowDataset):

- DIR itself, a `datasets` folder (`load_from_disk`, torch format) with one row per sequence: `input_ids` (the rendered
  prompt and the verifier's completion), `loss_mask` (1 on completion tokens, the ones the drafter learns to draft;
  0 on the prompt, as its own preprocessing masks everything but assistant turns) and `seq_len`;
- DIR/hidden_states/hs_{row}.safetensors (hs_connectors.FileTransfer), each with `token_ids` [seq_len] (checked
  against the row's input_ids) and `hidden_states` [seq_len, num_aux + 1, hidden]: the verifier's residual stream at
  each auxiliary layer id, then its last layer's output before the final norm (split off as
  `verifier_last_hidden_states`; the trainer applies the verifier's norm and LM head to it to get its targets).

speculators makes those hidden states with a vLLM server and a KV connector that writes them to disk; on this CPU we
compute the same tensors with transformers instead. Layer id i means "the residual stream entering verifier layer i"
(vLLM's aux_hidden_state_layers, and align's dflash.aux_layer_ids), which is transformers' hidden_states[i].

This module imports neither vllm nor speculators: speculators runs in vLLM's environment, as a subprocess
(experiments/speculators_dflash.sh).

    python -m align.speculators_data --trajectories data/tiny/trajectories-800 \
        --verifier checkpoints/tiny/verifier --layer-ids 1,3,6 --out data/tiny/speculators
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from align.config import RecipeError


def speculators_rows(trajectories: Any) -> list[dict[str, list[int] | int]]:
    """Trajectory rows (prompt_ids, completion_ids) -> speculators rows: input_ids = prompt + completion, loss_mask 0 on
    the prompt and 1 on the completion, seq_len. Rows with an empty completion carry nothing to learn and are dropped."""
    rows = []
    for row in trajectories:
        prompt, completion = list(row["prompt_ids"]), list(row["completion_ids"])
        if not completion:
            continue
        rows.append({"input_ids": prompt + completion, "loss_mask": [0] * len(prompt) + [1] * len(completion),
                     "seq_len": len(prompt) + len(completion)})
    return rows


@torch.no_grad()
def verifier_hidden_states(verifier: Any, input_ids: list[int], layer_ids: Sequence[int]) -> torch.Tensor:
    """The residual stream entering each verifier layer of `layer_ids`, then the last layer's output before the final
    norm: [seq_len, len(layer_ids) + 1, hidden], float32."""
    captured: dict[str, torch.Tensor] = {}
    # transformers returns the last hidden state after the final norm; speculators wants it before (its trainer
    # applies the verifier's norm itself), so take the norm's input.
    hook = verifier.model.norm.register_forward_hook(lambda m, args, out: captured.update(pre_norm=args[0]))
    try:
        out = verifier(torch.tensor([input_ids], device=verifier.device), output_hidden_states=True)
    finally:
        hook.remove()
    aux = [out.hidden_states[i][0] for i in layer_ids]  # hidden_states[i]: the input of layer i ([0]: embeddings)
    return torch.stack([*aux, captured["pre_norm"][0]], dim=1).float().cpu()


def check_layer_ids(layer_ids: Sequence[int], num_layers: int) -> None:
    if not layer_ids or len(set(layer_ids)) != len(layer_ids) or min(layer_ids) < 1 or max(layer_ids) >= num_layers:
        raise RecipeError(f"--layer-ids: {list(layer_ids)} must be distinct layer ids in [1, {num_layers - 1}] for a "
                          f"verifier with {num_layers} layers")


def write_draft_vocab(trajectories: Any, vocab_size: int, draft_vocab_size: int, out: Path) -> None:
    """out/d2t-{N}.npy and out/t2d-{N}.npy: the pruned draft vocabulary align's DFlash training picks from the same
    trajectories (dflash.most_frequent_tokens), in the files speculators' trainer reads for --draft-vocab-size N
    (speculators/train/cli.py parse_vocab_mappings), so that both trainers draft over the same tokens."""
    import numpy as np

    from align.drafters.dflash import most_frequent_tokens

    token_ids = most_frequent_tokens([row["completion_ids"] for row in trajectories],
                                     [row["prompt_ids"] for row in trajectories], draft_vocab_size, vocab_size)
    t2d = np.zeros(vocab_size, dtype=bool)
    t2d[token_ids.cpu().numpy()] = True
    np.save(out / f"d2t-{draft_vocab_size}.npy", (token_ids - torch.arange(draft_vocab_size)).cpu().numpy())
    np.save(out / f"t2d-{draft_vocab_size}.npy", t2d)


def convert(trajectories_dir: str | Path, verifier_path: str | Path, layer_ids: Sequence[int], out: str | Path,
            max_rows: int = 0, draft_vocab_size: int = 0, dtype: str = "float32") -> dict[str, Any]:
    """Write `out` (the speculators dataset folder and its hidden_states/) from align trajectories; returns the summary
    also written to out/align_conversion.json."""
    from datasets import Dataset
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from align.data import load_trajectories

    config = AutoConfig.from_pretrained(str(verifier_path))
    check_layer_ids(layer_ids, config.num_hidden_layers)
    if not 0 <= draft_vocab_size < config.vocab_size:
        raise RecipeError(f"--draft-vocab-size: {draft_vocab_size} must be in [0, {config.vocab_size}) (0: the "
                          "verifier's whole vocabulary)")
    trajectories = load_trajectories(trajectories_dir)
    # dtype: the verifier's, as align's training runs it (verifier.dtype); the files hold float32 either way
    verifier = AutoModelForCausalLM.from_pretrained(str(verifier_path), dtype=getattr(torch, dtype)).eval()
    rows = speculators_rows(trajectories)
    if max_rows:
        rows = rows[:max_rows]
    if not rows:
        raise RecipeError(f"--trajectories: {trajectories_dir} has no row with a non-empty completion")
    out = Path(out)
    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    for index, row in enumerate(rows):
        save_file({"token_ids": torch.tensor(row["input_ids"], dtype=torch.long),
                   "hidden_states": verifier_hidden_states(verifier, row["input_ids"], layer_ids).contiguous()},
                  str(out / "hidden_states" / f"hs_{index}.safetensors"))
    dataset = Dataset.from_list(rows)
    dataset.set_format(type="torch")  # as speculators' own prepare_data saves it: the trainer compares tensors
    dataset.save_to_disk(str(out))
    if draft_vocab_size:
        write_draft_vocab(trajectories, config.vocab_size, draft_vocab_size, out)
    summary = {"trajectories": str(trajectories_dir), "verifier": str(verifier_path), "layer_ids": list(layer_ids),
               "dtype": dtype, "rows": len(rows), "tokens": sum(r["seq_len"] for r in rows),
               "max_seq_len": max(r["seq_len"] for r in rows),
               "completion_tokens": sum(sum(r["loss_mask"]) for r in rows)}
    (out / "align_conversion.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m align.speculators_data", description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", required=True, help="an align trajectories folder (its manifest.json)")
    parser.add_argument("--verifier", required=True, help="the verifier folder the trajectories were made with")
    parser.add_argument("--layer-ids", required=True, help="comma-separated auxiliary layer ids (dflash.aux_layer_ids)")
    parser.add_argument("--out", required=True, help="the speculators dataset folder to write")
    parser.add_argument("--max-rows", type=int, default=0, help="convert at most this many rows (0: all)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the dtype the verifier runs in (align's verifier.dtype)")
    parser.add_argument("--draft-vocab-size", type=int, default=0,
                        help="also write the d2t/t2d maps of align's pruned draft vocabulary of this size "
                             "(dflash.draft_vocab_size; 0: none)")
    args = parser.parse_args(argv)
    try:
        try:
            layer_ids = [int(x) for x in args.layer_ids.split(",")]
        except ValueError:
            raise RecipeError(f"--layer-ids: {args.layer_ids!r} is not a comma-separated list of integers") from None
        if not (Path(args.trajectories) / "manifest.json").is_file():
            raise RecipeError(f"--trajectories: {args.trajectories} has no manifest.json (run align trajectories)")
        if not (Path(args.verifier) / "config.json").is_file():
            raise RecipeError(f"--verifier: {args.verifier} has no config.json")
        summary = convert(args.trajectories, args.verifier, layer_ids, args.out, args.max_rows,
                          args.draft_vocab_size, args.dtype)
    except RecipeError as e:
        print(f"align.speculators_data: {e}", file=sys.stderr)
        return 2
    print(f"speculators dataset: {summary['rows']} rows, {summary['tokens']} tokens "
          f"({summary['completion_tokens']} supervised) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
