"""The script the DeepSpeed launcher runs on every rank; `align train` with the same arguments:

    deepspeed --num_gpus 2 align/train.py recipes/tiny/align.yaml [key=value ...]
    python align/train.py recipes/tiny/align.yaml                                   # 1 process, no launcher

The stage itself is align/stages/train.py. This file is a script only: it imports nothing when imported.
"""

if __name__ == "__main__":
    import runpy
    import sys
    from pathlib import Path

    # Run as a script, this file's folder comes first on sys.path, where align's own modules (config, data, ...)
    # would shadow top-level packages of the same names. The checkout this file is in goes first instead, so that the
    # ranks run this checkout's align, never another one installed in the environment (a second clone or worktree).
    here, checkout = Path(__file__).resolve().parent, str(Path(__file__).resolve().parents[1])
    sys.path[:] = [checkout, *(p for p in sys.path if Path(p or ".").resolve() != here and p != checkout)]
    # Run as the `align` command is (its interrupt handling first, before torch is imported): the CLI is the program
    # here, not a module this script imports.
    sys.argv = ["align", "train", *sys.argv[1:]]
    runpy.run_module("align.cli", run_name="__main__", alter_sys=True)
