"""`align states` (align/stages/states.py) and states.out in training (align/drafters/states_store.py): the verifier's
hidden states computed once, split over ranks, resumable and checked, train as computing them in the step does, with
no verifier layer loaded by the training ranks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from align.drafters.states_store import CHUNK_FILE, CHUNK_RECORD, STATES_MANIFEST, chunk_plan

ROOT = Path(__file__).resolve().parents[2]


def test_chunks_are_cut_by_bytes_with_one_row_at_least():
    assert chunk_plan([3, 3, 3, 3], token_bytes=2, chunk_bytes=12) == [(0, 2), (2, 4)]
    assert chunk_plan([10, 1, 1], token_bytes=2, chunk_bytes=12) == [(0, 1), (1, 3)]  # a row over the size: alone
    assert chunk_plan([], token_bytes=2, chunk_bytes=12) == []


def test_the_ends_of_a_verifier_are_its_own_embeddings_and_head(tmp_path):
    """load_verifier_ends: no decoder layer, the embeddings (Gemma's scaled) and the head (tied or not) as the whole
    model's, and a checkpoint tensor of anything but a layer still refused."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, Qwen3Config

    from align.config import RecipeError, VerifierSection
    from align.models import load_verifier_ends

    sizes = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)
    for name, config in (("gemma", Gemma3TextConfig(**sizes)), ("qwen", Qwen3Config(**sizes, tie_word_embeddings=False))):
        whole = AutoModelForCausalLM.from_config(config)
        whole.save_pretrained(tmp_path / name)
        ends = load_verifier_ends(VerifierSection(path=str(tmp_path / name), dtype="float32"))
        assert len(ends.model.layers) == 0
        ids = torch.tensor([[1, 2, 299]])
        assert torch.equal(ends.get_input_embeddings()(ids), whole.get_input_embeddings()(ids))
        assert torch.equal(ends.get_output_embeddings().weight, whole.get_output_embeddings().weight)
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "qwen" / "model.safetensors")
    save_file({**weights, "model.extra.weight": torch.zeros(2)}, tmp_path / "qwen" / "model.safetensors")
    with pytest.raises(RecipeError, match="model.extra.weight is in the checkpoint"):
        load_verifier_ends(VerifierSection(path=str(tmp_path / "qwen"), dtype="float32"))


# align train with the whole verifier's loading refused: a run on states.out must load only its ends.
NO_WHOLE_VERIFIER = """
import sys
import align.stages.train as train

def refused(section):
    raise AssertionError("align train loaded the whole verifier")

train.load_verifier = refused
from align.cli import main
raise SystemExit(main(["train", *sys.argv[1:]]))
"""


def run(*args, **env):
    from conftest import checkout_env

    return subprocess.run([sys.executable, "-m", "align.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env=checkout_env(HF_HUB_OFFLINE="1", **env), timeout=600)


@pytest.mark.slow
def test_states_split_over_ranks_resume_and_train_as_the_verifier_does(toy_trajectories, tmp_path):
    """2 ranks write the chunks between them; each row's stored states are the verifier's for that row alone (fp32);
    a chunk lost is the only one computed again; training on them gives the losses of a run that runs the verifier
    in its steps, a KD loss's too, with no verifier layer loaded; bad or foreign states are refused in one line."""
    from align.drafters.dflash import verifier_states
    from align.launch import free_port
    from conftest import TOY_TRAJECTORIES, checkout_env

    root, traj = toy_trajectories
    states = tmp_path / "states"
    common = [f"verifier.path={root / 'ck' / 'verifier'}", f"trajectories.out={traj}", *TOY_TRAJECTORIES,
              f"data.dir={root / 'data'}", "train.gamma=4", "train.windows_per_sequence=4", "train.max_steps=6",
              "train.micro_batch_size=2", "train.eval_every=3", "train.save_every=6", "train.final_eval_prompts=0",
              "train.losses={ce_streak: 1.0, fkl: 1.0}", "dflash.aux_layer_ids=[0]", "dflash.intermediate_size=48",
              "train.report_to=none", "verifier.dtype=float32", "drafter.dtype=float32", "train.bf16=false"]
    made = [*common, f"states.out={states}", "states.chunk_mib=0.05", "states.batch_size=3"]
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           "--module", "align.cli", "states", "recipes/tiny/dflash.yaml", *made]
    done = subprocess.run(cmd, cwd=ROOT, env=checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    manifest = json.loads((states / STATES_MANIFEST).read_text())
    assert len(manifest["chunks"]) >= 3 and manifest["settings"]["final_states"]
    assert manifest["width"] == 2 * 32  # layer 0 and the final states, of the 32-wide toy verifier

    from align.config import VerifierSection
    from align.data import load_trajectories
    from align.drafters.states_store import StatesStore
    from align.models import load_verifier

    rows = load_trajectories(traj)
    verifier = load_verifier(VerifierSection(path=str(root / "ck" / "verifier"), dtype="float32"))
    store = StatesStore(states, manifest, manifest["width"], torch.float32)
    for r in range(len(rows)):
        ids = torch.tensor([rows[r]["prompt_ids"] + rows[r]["completion_ids"]])
        expected = verifier_states(verifier, ids, [0], with_last=True)[0]
        torch.testing.assert_close(store.get(r), expected, rtol=1e-5, atol=1e-5)

    # Resumable: a chunk lost (its record gone) is computed again, the others are left as they were.
    written = {p.parent.name: p.stat().st_mtime_ns for p in (states / "chunks").glob(f"*/{CHUNK_FILE}")}
    (states / "chunks" / "chunk-00001" / CHUNK_RECORD).unlink()
    again = run("states", "recipes/tiny/dflash.yaml", *made)
    assert again.returncode == 0, again.stderr[-2000:]
    now = {p.parent.name: p.stat().st_mtime_ns for p in (states / "chunks").glob(f"*/{CHUNK_FILE}")}
    assert [name for name in written if now[name] != written[name]] == ["chunk-00001"]

    # Training reads them (in a batch worker), loading no decoder layer of the verifier (a whole one refused by the
    # script below), to the losses of a run that runs it.
    script = tmp_path / "no_whole_verifier.py"
    script.write_text(NO_WHOLE_VERIFIER)
    losses = {}
    for with_states in (False, True):
        out = tmp_path / f"run-{with_states}"
        args = ["recipes/tiny/dflash.yaml", *common, f"train.out={out}"]
        # With states.out a worker process reads each batch's states ahead of its step (align/batches.py).
        done = (subprocess.run([sys.executable, str(script), *args, f"states.out={states}", "train.batch_workers=1"],
                               cwd=ROOT, capture_output=True, text=True, env=checkout_env(HF_HUB_OFFLINE="1"),
                               timeout=600)
                if with_states else run("train", *args))
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        losses[with_states] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses[True]) == len(losses[False])
    for a, b in zip(losses[True], losses[False]):
        for key in ("loss", "fkl", "expected_streak"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-4), (key, a, b)

    # Refused before any work, in one line: other settings (a length cap the states were not cut at), a damaged chunk.
    other = run("train", "recipes/tiny/dflash.yaml", *common, f"train.out={tmp_path / 'other'}",
                f"states.out={states}", "train.max_sequence_length=16")
    assert other.returncode == 2 and other.stderr.count("\n") == 1, other.stderr
    assert "states.out: " in other.stderr and "max_sequence_length None" in other.stderr
    chunk = states / "chunks" / "chunk-00000" / CHUNK_FILE
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0xFF
    chunk.write_bytes(bytes(data))
    damaged = run("train", "recipes/tiny/dflash.yaml", *common, f"train.out={tmp_path / 'damaged'}",
                  f"states.out={states}")
    assert damaged.returncode == 2 and damaged.stderr.count("\n") == 1, damaged.stderr
    assert f"{chunk} is missing or corrupted (checksum mismatch)" in damaged.stderr
    assert not (tmp_path / "damaged").exists()
