"""align trajectories -> speculators' offline DFlash dataset (align/speculators_data.py), on a tiny trajectory set
written here and the shipped tiny verifier."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from align.disk import file_sha256
from align.speculators_data import convert, main, speculators_rows

ROOT = Path(__file__).resolve().parents[2]
VERIFIER = ROOT / "checkpoints" / "tiny" / "verifier"


def write_trajectories(folder: Path, rows: list[dict]) -> None:
    """A trajectories folder as align trajectories leaves one: an Arrow chunk and a manifest of its checksums."""
    from datasets import Dataset

    chunk = folder / "chunks" / "0"
    Dataset.from_list(rows).save_to_disk(str(chunk))
    files = {p.name: file_sha256(p) for p in chunk.glob("*.arrow")}
    (folder / "manifest.json").write_text(json.dumps({"chunks": {"0": files}, "settings": {}}))


ROWS = [{"prompt_ids": [5, 6, 7], "completion_ids": [8, 9, 10, 11, 0]},
        {"prompt_ids": [12, 13], "completion_ids": []},  # nothing to learn: dropped
        {"prompt_ids": [14], "completion_ids": [15, 16]}]


def test_rows_concatenate_prompt_and_completion_and_mask_the_prompt():
    rows = speculators_rows(ROWS)
    assert rows == [
        {"input_ids": [5, 6, 7, 8, 9, 10, 11, 0], "loss_mask": [0, 0, 0, 1, 1, 1, 1, 1], "seq_len": 8},
        {"input_ids": [14, 15, 16], "loss_mask": [0, 1, 1], "seq_len": 3},
    ]


@pytest.mark.skipif(not VERIFIER.is_dir(), reason="the shipped tiny verifier is missing")
def test_convert_writes_the_dataset_and_hidden_states_speculators_reads(tmp_path):
    from datasets import load_from_disk
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    write_trajectories(tmp_path / "traj", ROWS)
    summary = convert(tmp_path / "traj", VERIFIER, [1, 3, 6], tmp_path / "spec")
    assert summary["rows"] == 2 and summary["tokens"] == 11 and summary["completion_tokens"] == 7

    dataset = load_from_disk(str(tmp_path / "spec"))
    assert dataset.format["type"] == "torch"  # speculators compares the row's input_ids with torch.equal
    assert dataset[0]["input_ids"].tolist() == [5, 6, 7, 8, 9, 10, 11, 0]
    assert dataset[0]["loss_mask"].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert dataset.with_format(None)["seq_len"] == [8, 3]

    saved = load_file(str(tmp_path / "spec" / "hidden_states" / "hs_0.safetensors"))
    assert torch.equal(saved["token_ids"], dataset[0]["input_ids"])
    verifier = AutoModelForCausalLM.from_pretrained(str(VERIFIER), dtype=torch.float32).eval()
    assert saved["hidden_states"].shape == (8, 4, verifier.config.hidden_size)
    with torch.no_grad():
        out = verifier(torch.tensor([[5, 6, 7, 8, 9, 10, 11, 0]]), output_hidden_states=True)
    # Layer id i is the residual stream entering layer i (transformers' hidden_states[i], vLLM's aux layer i) ...
    for slot, layer in enumerate([1, 3, 6]):
        torch.testing.assert_close(saved["hidden_states"][:, slot], out.hidden_states[layer][0])
    # ... and the last slot is the last layer's output before the final norm: the trainer's targets are the
    # verifier's norm and LM head applied to it, which must give the verifier's own logits.
    logits = verifier.lm_head(verifier.model.norm(saved["hidden_states"][:, -1]))
    torch.testing.assert_close(logits, out.logits[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(saved["hidden_states"][:, -1], out.hidden_states[-1][0])  # not the normed one


def test_bad_layer_ids_are_refused_in_one_line_before_any_work(tmp_path, capsys):
    write_trajectories(tmp_path / "traj", ROWS)
    capsys.readouterr()  # datasets' progress bar
    for layer_ids in ("1,x", "1,7"):  # not integers; layer 7 of a 7-layer verifier does not exist
        code = main(["--trajectories", str(tmp_path / "traj"), "--verifier", str(VERIFIER), "--layer-ids", layer_ids,
                     "--out", str(tmp_path / "spec")])
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.count("\n") == 1 and "--layer-ids" in err
    assert not (tmp_path / "spec").exists()


def test_the_module_exits_2_on_bad_input(tmp_path):
    run = subprocess.run([sys.executable, "-m", "align.speculators_data", "--trajectories", str(tmp_path / "none"),
                          "--verifier", str(VERIFIER), "--layer-ids", "1", "--out", str(tmp_path / "spec")],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and "manifest.json" in run.stderr and run.stderr.count("\n") == 1


@pytest.mark.skipif(not VERIFIER.is_dir(), reason="the shipped tiny verifier is missing")
def test_draft_vocab_files_hold_the_tokens_align_keeps_in_speculators_layout(tmp_path):
    """speculators' trainer reads d2t-{N}.npy / t2d-{N}.npy from the data folder for --draft-vocab-size N: target id =
    draft index + d2t[draft index], t2d a mask over the verifier's vocabulary. They hold align's own choice."""
    import numpy as np

    from align.drafters.dflash import most_frequent_tokens

    write_trajectories(tmp_path / "traj", ROWS)
    convert(tmp_path / "traj", VERIFIER, [1, 3, 6], tmp_path / "spec", draft_vocab_size=8)
    d2t, t2d = np.load(tmp_path / "spec" / "d2t-8.npy"), np.load(tmp_path / "spec" / "t2d-8.npy")
    kept = d2t + np.arange(8)
    vocab_size = len(t2d)
    expected = most_frequent_tokens([r["completion_ids"] for r in ROWS], [r["prompt_ids"] for r in ROWS], 8, vocab_size)
    assert kept.tolist() == expected.tolist()
    assert set(kept) >= {8, 9, 10, 11, 0, 15, 16}  # every completion token is draftable (7 of them, 8 kept)
    assert t2d.dtype == bool and t2d.sum() == 8 and t2d[kept].all()
    code = main(["--trajectories", str(tmp_path / "traj"), "--verifier", str(VERIFIER), "--layer-ids", "1",
                 "--out", str(tmp_path / "bad"), "--draft-vocab-size", str(vocab_size)])
    assert code == 2 and not (tmp_path / "bad").exists()
