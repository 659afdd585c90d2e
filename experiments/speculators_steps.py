"""Small steps of experiments/speculators_dflash.sh that read speculators' and align's JSON files (kept here, not as
Python embedded in the shell script):

  python experiments/speculators_steps.py max-len DATA/align_conversion.json    the converted dataset's max_seq_len
  python experiments/speculators_steps.py step-folder TRAIN MAX_STEPS          the first epoch folder of speculators'
                                                                               trainer at >= MAX_STEPS steps, or ""
  python experiments/speculators_steps.py table WORK                           both serve-checks as one table
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def max_len(conversion: str) -> str:
    return str(json.loads(Path(conversion).read_text())["max_seq_len"])


def step_folder(train: str, max_steps: str) -> str:
    # speculators 0.9.0's --max-steps ends an epoch, not the run: the script stops the trainer at the first epoch
    # checkpoint whose training_state.json has reached max_steps.
    done = [(json.loads(p.read_text())["global_step"], int(p.parent.name))
            for p in Path(train).glob("*/training_state.json") if p.parent.name.isdigit()]
    reached = sorted(epoch for step, epoch in done if step >= int(max_steps))
    return str(Path(train) / str(reached[0])) if reached else ""


def table(work: str) -> str:
    rows = ["| drafter | align tau | vLLM mean acceptance length | vLLM speedup | outputs identical |",
            "|---|---|---|---|---|"]
    for which in ("speculators", "align"):
        path = Path(work) / f"serve-check-{which}" / "serve_check.json"
        if not path.is_file():
            rows.append(f"| {which} | (no serve_check.json) | | | |")
            continue
        r = json.loads(path.read_text())
        rows.append(f"| {which} | {r['align']['tau']:.2f} | {r['vllm_drafter']['mean_acceptance_length']:.2f} | "
                    f"{r['check']['vllm_speedup']:.2f}x | {r['vllm_drafter']['identical']} |")
    return "\n".join(rows)


if __name__ == "__main__":
    steps = {"max-len": max_len, "step-folder": step_folder, "table": table}
    if len(sys.argv) < 2 or sys.argv[1] not in steps:
        print(f"usage: speculators_steps.py {{{','.join(steps)}}} ARGS...", file=sys.stderr)
        sys.exit(2)
    print(steps[sys.argv[1]](*sys.argv[2:]))
