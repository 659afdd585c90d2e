"""The script the DeepSpeed launcher runs on every rank; `align train` with the same arguments:

    deepspeed --num_gpus 2 align/train.py recipes/tiny/align.yaml [key=value ...]
    python align/train.py recipes/tiny/align.yaml                                   # 1 process, no launcher

The stage itself is align/stages/train.py. This file is a script only: it imports nothing when imported.
"""

if __name__ == "__main__":
    import logging
    import os
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
    try:
        runpy.run_module("align.cli", run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as done:
        if done.code is not None and not isinstance(done.code, int):
            print(done.code, file=sys.stderr)
        status = done.code if isinstance(done.code, int) else int(done.code is not None)
    if "LOCAL_RANK" in os.environ:
        # A rank the launcher started has finished (its process group destroyed, its files written): leave without the
        # interpreter's teardown, where a C++ thread of the collectives' backend still joinable at destruction
        # aborted about one 2-rank run in 30 on a CPU ("terminate called without an active exception", exit -6),
        # after a clean finish, and the launcher then reported the run failed.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
