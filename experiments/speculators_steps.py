"""Small steps of experiments/speculators_dflash.sh that read speculators' and align's JSON files (kept here, not as
Python embedded in the shell script):

  python experiments/speculators_steps.py max-len DATA/align_conversion.json    the converted dataset's max_seq_len
  python experiments/speculators_steps.py step-folder TRAIN MAX_STEPS          the first epoch folder of speculators'
                                                                               trainer at >= MAX_STEPS steps, or ""
  python experiments/speculators_steps.py table WORK                           both serve-checks as one table
  python experiments/speculators_steps.py bidirectional FOLDER                 a speculators folder of full layers
                                                                               set to be served as trained

and of experiments/speculators_curves.sh:

  python experiments/speculators_steps.py newest-state TRAIN      "FOLDER GLOBAL_STEP MTIME" of speculators' newest
                                                                  checkpoint, or ""
  python experiments/speculators_steps.py align-times TRAIN START "SECONDS<TAB>FOLDER" a line per align checkpoint
  python experiments/speculators_steps.py pick TIMES SECONDS      the newest checkpoint of TIMES written by SECONDS
  python experiments/speculators_steps.py curves WORK BUDGET...   the table of every budget, and WORK/curves.png
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


def newest_state(train: str) -> str:
    # training_state.json is the last file speculators writes for a checkpoint (trainer.py maybe_save_checkpoint)
    states = sorted(Path(train).glob("*/training_state.json"), key=lambda p: p.stat().st_mtime)
    if not states:
        return ""
    step = json.loads(states[-1].read_text())["global_step"]
    return f"{states[-1].parent} {step} {int(states[-1].stat().st_mtime)}"


def align_times(train: str, start: str) -> str:
    # .align is the last file align writes into a step folder (its completion mark)
    marks = sorted(Path(train).glob("step_*/.align"), key=lambda p: int(p.parent.name.split("_")[1]))
    return "\n".join(f"{int(p.stat().st_mtime) - int(start)}\t{p.parent}" for p in marks)


def bidirectional(folder: str) -> str:
    # speculators trains full_attention layers bidirectionally whatever sliding_window_non_causal says, and writes it
    # false; vLLM 0.32 reads it for every layer and would serve them block-causal (docs/dflash-and-vllm.md)
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    if set(config["transformer_layer_config"].get("layer_types") or ["full_attention"]) == {"full_attention"}:
        config["sliding_window_non_causal"] = True
        path.write_text(json.dumps(config, indent=2))
    return f"{folder}: sliding_window_non_causal {str(config.get('sliding_window_non_causal')).lower()}"


def read_times(times: str) -> list[tuple[int, str]]:
    if not Path(times).is_file():  # a trainer this run left out (TRAINERS=align): no snapshots of it
        return []
    rows = [line.split("\t") for line in Path(times).read_text().splitlines() if line.strip()]
    return [(int(seconds), folder) for seconds, folder in rows]


def pick(times: str, seconds: str) -> str:
    # a snapshot copied while speculators rewrote its epoch folder can be empty: only complete ones (config.json)
    within = [(s, folder) for s, folder in read_times(times)
              if s <= int(seconds) and (Path(folder) / "config.json").is_file()]
    return max(within)[1] if within else ""


def curves(work: str, *budgets: str) -> str:
    rows = ["| budget (min) | speculators: step, vLLM acceptance, align tau | align: step, vLLM acceptance, align tau "
            "| align / speculators (vLLM acceptance) |", "|---|---|---|---|"]
    points: dict[str, list[tuple[float, float]]] = {"spec": [], "align": []}
    for budget in budgets:
        cells, served = [], {}
        for which in ("spec", "align"):
            folder = pick(str(Path(work) / f"{which}-times.tsv"), str(int(budget) * 60))
            path = Path(work) / f"serve-{which}-{budget}" / "serve_check.json"
            if not folder or not path.is_file():
                cells.append("(none)")
                continue
            r = json.loads(path.read_text())
            served[which] = r["vllm_drafter"]["mean_acceptance_length"]
            points[which].append((float(budget), served[which]))
            cells.append(f"{Path(folder).name}, {served[which]:.2f}, {r['align']['tau']:.2f}")
        ratio = f"{served['align'] / served['spec']:.2f}x" if len(served) == 2 else ""
        rows.append(f"| {budget} | {cells[0]} | {cells[1]} | {ratio} |")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for which, label in (("align", "align train"), ("spec", "speculators train")):
        if points[which]:
            ax.plot(*zip(*points[which]), marker="o", label=label)
    ax.set_xlabel("training wall-clock minutes (2-core CPU)")
    ax.set_ylabel("vLLM mean acceptance length")
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(work) / "curves.png", dpi=120)
    return "\n".join(rows)


if __name__ == "__main__":
    steps = {"max-len": max_len, "step-folder": step_folder, "table": table, "newest-state": newest_state,
             "align-times": align_times, "pick": pick, "curves": curves, "bidirectional": bidirectional}
    if len(sys.argv) < 2 or sys.argv[1] not in steps:
        print(f"usage: speculators_steps.py {{{','.join(steps)}}} ARGS...", file=sys.stderr)
        sys.exit(2)
    print(steps[sys.argv[1]](*sys.argv[2:]))
