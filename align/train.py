"""The script the DeepSpeed launcher runs on every rank: `deepspeed align/train.py recipe.yaml [key=value ...]` is
`align train recipe.yaml [key=value ...]` (the stage itself is align/training.py)."""

import sys
from pathlib import Path

if __name__ == "__main__":
    # Run as a script, this file's folder comes first on sys.path, where align's own modules (config, data, ...)
    # would shadow top-level packages of the same names.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    from align.cli import main

    raise SystemExit(main(["train", *sys.argv[1:]]))
