"""The steps of launch/gpu_check.sh that are Python rather than an align command (kept here, not embedded in the
script). Run from the repository root; the test helpers they reuse live in tests/.

  python launch/gpu_check_steps.py has-dependencies      exit 0 when this python has align's dependencies
  python launch/gpu_check_steps.py torch-version
  python launch/gpu_check_steps.py remote-code OUT DEVICE tiny Dream and LLaDA as the Hub lays them out, loaded
                                                         through align's loader and shims, one forward on DEVICE
  python launch/gpu_check_steps.py zero3-prepare OUT     a tiny DiffusionGemma, its Gemma 4 verifier and trajectories
                                                         of 40, 3 and 2 tokens; the train overrides in OUT/args.txt
  python launch/gpu_check_steps.py zero3-losses METRICS  the ZeRO-3 run's three losses, finite
  python launch/gpu_check_steps.py memory-table OUT      the CPU probe beside cuda's max_memory_allocated
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
from pathlib import Path

# remote_code_families (tests/), test_diffusion_gemma (tests/drafters/) and test_zero3 (tests/stages/) build the tiny
# models.
sys.path[:0] = ["tests", "tests/drafters", "tests/stages"]


def has_dependencies() -> None:
    for name in ("torch", "transformers", "deepspeed", "peft", "pydantic", "safetensors"):
        importlib.import_module(name)


def torch_version() -> None:
    import torch

    print(torch.__version__)


def remote_code(out: str, device: str) -> int:
    import torch
    from remote_code_families import code_folder, write_family

    from align.config import DrafterSection
    from align.drafters.loading import load_drafter
    from align.models import load_tokenizer
    from align.remote_code import masks_ignored, shims_applied

    failed = False
    for name in ("dream", "llada"):
        where = "real files, ALIGN_REMOTE_CODE" if os.environ.get("ALIGN_REMOTE_CODE") else "fixtures"
        code = f"{code_folder(name)} ({where})"
        try:
            folder = write_family(name, Path(out) / name, seed=3)
            section = DrafterSection(path=str(folder), trust_remote_code=True, device=device, dtype="float32")
            model, spec = load_drafter(section, load_tokenizer(str(folder), True))
            assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
            at = next(model.parameters()).device
            ids = torch.tensor([[5, 6, 7, 8, spec.mask_token_id]], device=at)
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            assert logits.shape[:2] == (1, 5) and bool(torch.isfinite(logits).all()), logits.shape
            print(f"gpu_check: PASS remote_code {name}: {code}: {type(model).__name__} on {at.type}, shims "
                  f"{sorted(shims_applied(model))}, masks ignored {masks_ignored(model)}")
        except Exception as e:  # noqa: BLE001 - reported, and the other family still runs
            print(f"gpu_check: FAIL remote_code {name}: {code}: {type(e).__name__}: {e}")
            failed = True
    return 1 if failed else 0


def zero3_prepare(out: str) -> None:
    from test_diffusion_gemma import RECIPE
    from test_zero3 import canvas_setup, write_trajectories

    from align.recipe_files import load_recipe

    root = Path(out)
    args = [*canvas_setup(root), "train.save_every=3", "train.bf16=true", f"train.out={root / 'run'}"]
    # Trajectories as `align trajectories` writes them, of random token ids with test_zero3's completion lengths.
    write_trajectories(load_recipe(RECIPE, args), root / "trajectories")
    (root / "args.txt").write_text("\n".join(args) + "\n")


def zero3_losses(metrics: str) -> None:
    records = [json.loads(line) for line in open(metrics)]
    assert [r["step"] for r in records] == [1, 2, 3], records
    assert all(math.isfinite(r["loss"]) for r in records), records
    print("gpu_check: zero3: losses " + ", ".join(f"{r['loss']:.4g}" for r in records))


def memory_table(out: str) -> None:
    m = Path(out)
    cpu = json.loads((m / "cpu.json").read_text())
    cuda = json.loads((m / "cuda.json").read_text()) if (m / "cuda.json").is_file() else None
    rows = [(f"measured {k}", cpu["measured_bytes"][k], cuda and cuda["measured_bytes"][k])
            for k in cpu["measured_bytes"]] + [("per GPU peak", cpu["per_gpu_bytes"]["total"],
                                                cuda and cuda["per_gpu_bytes"]["total"])]
    print(f"gpu_check: memory  {'':30} {'CPU probe':>12} {'cuda max_memory_allocated':>26}")
    for name, a, b in rows:
        print(f"gpu_check: memory  {name:30} {a / 1e9:9.3f} GB "
              + (f"{b / 1e9:22.3f} GB  (x{b / a:.2f})" if b is not None else f"{'(no GPU)':>25}"))


STEPS = {"has-dependencies": has_dependencies, "torch-version": torch_version, "remote-code": remote_code,
         "zero3-prepare": zero3_prepare, "zero3-losses": zero3_losses, "memory-table": memory_table}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in STEPS:
        print(f"usage: gpu_check_steps.py {{{','.join(STEPS)}}} ARGS...", file=sys.stderr)
        sys.exit(2)
    sys.exit(STEPS[sys.argv[1]](*sys.argv[2:]) or 0)
