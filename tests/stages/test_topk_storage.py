"""Top-k log-probs kept as generation runs (no step's full-vocabulary logits outlive it), stored as float16 log-probs
and int32 ids, and rebuilt for training by one scatter that gives what the per-token builder gave."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from align.drafters.spec import DrafterSpec
from align.recipe_files import load_recipe
from align.stages.trajectories import sample_chunk, write_chunk
from align.windows import WINDOW_BUILDERS, topk_window_logits

from conftest import checkout_env

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "checkpoints" / "tiny" / "tokenizer"
PROMPTS = ["def add(a, b):\n    return", "import os\n", "class Stack:\n    def push(self, item):\n        self."]
K, NEW_TOKENS, SEED = 6, 12, 3


def tiny_llama(vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, pad_token_id=1,
        bos_token_id=None)).eval()


@pytest.fixture(scope="module")
def sampled(one_thread):
    """Sampled completions with their stored top-k, and the full logits of the same generate() call."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    model = tiny_llama(len(tokenizer))
    prompt_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS]
    # Sampled through temperature and top-p warpers: what is stored must be the verifier's own distribution.
    recipe = load_recipe(None, ["trajectories.temperature=0.8", "trajectories.top_p=0.5", f"trajectories.store_topk={K}",
                                f"trajectories.max_new_tokens={NEW_TOKENS}", "trajectories.completions_per_prompt=2"])
    end_tokens = frozenset({tokenizer.eos_token_id})
    rows = sample_chunk(model, tokenizer, prompt_ids, recipe, SEED, end_tokens)
    # The same call, asking generate() for every step's logits (what store_topk used to keep).
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompt_ids}, padding=True, return_tensors="pt")
    torch.manual_seed(SEED)
    with torch.inference_mode():
        full = model.generate(**batch, do_sample=True, temperature=0.8, top_p=0.5, top_k=0,
                              max_new_tokens=NEW_TOKENS, num_return_sequences=2, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=sorted(end_tokens), output_logits=True, return_dict_in_generate=True)
    return rows, full, batch.input_ids.shape[1]


def test_stored_topk_is_the_topk_of_the_full_logits(sampled):
    rows, full, width = sampled
    for r, row in enumerate(rows):
        assert row["completion_ids"] == full.sequences[r, width:width + len(row["completion_ids"])].tolist()
        assert row["topk_ids"].dtype == np.int32 and row["topk_logprobs"].dtype == np.float16
        assert row["topk_ids"].shape == row["topk_logprobs"].shape == (len(row["completion_ids"]), K)
        logits = torch.stack([step[r] for step in full.logits[: len(row["completion_ids"])]]).float()
        top = torch.log_softmax(logits, -1).topk(K, dim=-1)
        assert torch.equal(torch.from_numpy(row["topk_ids"]).long(), top.indices)
        # float16 keeps 11 significant bits: within half a unit in the last place of each value
        stored = torch.from_numpy(row["topk_logprobs"].astype(np.float32))
        assert torch.all((stored - top.values).abs() <= top.values.abs() * 2.0 ** -11 + 1e-7)
    # The warpers were in force (top-p 0.5 leaves few tokens), yet what is stored is the unwarped distribution.
    assert all(np.isfinite(row["topk_logprobs"]).all() for row in rows)


def test_chunks_store_float16_log_probs_and_int32_ids(sampled, tmp_path):
    from datasets import List, Value, load_from_disk

    rows, _, _ = sampled
    write_chunk([{**row, "prompt_index": i} for i, row in enumerate(rows)], tmp_path / "chunk", "h")
    data = load_from_disk(str(tmp_path / "chunk"))
    assert data.features["topk_logprobs"] == List(List(Value("float16")))
    assert data.features["topk_ids"] == List(List(Value("int32")))
    assert data[0]["topk_ids"] == rows[0]["topk_ids"].tolist()
    assert data[0]["topk_logprobs"] == rows[0]["topk_logprobs"].astype(np.float64).tolist()  # exactly, read back


def per_token_topk_window_logits(rows, batch, vocab):
    """The builder before the scatter (align/windows.py until this change), kept here as the reference."""
    B, W, gamma = batch.targets.shape
    out = torch.full((B, W, gamma, vocab), float("-inf"), device=batch.targets.device)
    for b in range(B):
        row = rows[int(batch.source_rows[b])]
        p = len(row["prompt_ids"])
        for w in range(W):
            for i in range(gamma):
                if batch.target_mask[b, w, i]:
                    k = int(batch.starts[b, w]) + i - p  # completion position
                    out[b, w, i, row["topk_ids"][k]] = torch.tensor(row["topk_logprobs"][k], device=out.device)
    out[~batch.target_mask] = 0.0
    return out


@pytest.mark.parametrize("stored_as", ["float16 chunk", "float64 lists"])
@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_the_scatter_rebuilds_what_the_per_token_builder_did(sampled, tmp_path, attention, stored_as):
    from datasets import load_from_disk

    rows, _, _ = sampled
    vocab = int(max(row["topk_ids"].max() for row in rows)) + 5
    if stored_as == "float16 chunk":  # as align train reads them: dicts of Python lists
        write_chunk([{**row, "prompt_index": i} for i, row in enumerate(rows)], tmp_path / "chunk", "h")
        data = load_from_disk(str(tmp_path / "chunk"))
        rows = [data[i] for i in range(len(data))]
    else:  # trajectories made before this change: float64 log-probs, int64 ids
        rows = [{**row, "topk_ids": row["topk_ids"].astype(np.int64).tolist(),
                 "topk_logprobs": (row["topk_logprobs"].astype(np.float64) - 1e-4).tolist()} for row in rows]
    spec = DrafterSpec(vocab - 1, 0, attention)
    batch = WINDOW_BUILDERS[attention](rows, spec, 4, 3, 1, np.random.default_rng(0))
    assert batch.target_mask.sum() > 10
    got = topk_window_logits(rows, batch, vocab)
    assert torch.equal(got, per_token_topk_window_logits(rows, batch, vocab))
    assert torch.isfinite(got[batch.target_mask]).sum() == K * int(batch.target_mask.sum())


# Run in its own process: its peak resident memory is then this generation's alone.
PEAK = """
import json, resource, sys
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from align.recipe_files import load_recipe
from align.stages.trajectories import sample_chunk

vocab, steps = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
tokenizer = AutoTokenizer.from_pretrained(sys.argv[3])
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                     eos_token_id=None, pad_token_id=1, bos_token_id=None)).eval()
prompts = [tokenizer(p, add_special_tokens=False).input_ids for p in ("def f(x):", "import os\\nimport sys\\n")]
settings = ["trajectories.temperature=1", "trajectories.store_topk=8", "trajectories.completions_per_prompt=2"]
sample_chunk(model, tokenizer, prompts, load_recipe(None, [*settings, "trajectories.max_new_tokens=2"]), 0,
             frozenset())  # warm-up: lazy initialisation is not this measurement
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
rows = sample_chunk(model, tokenizer, prompts, load_recipe(None, [*settings, f"trajectories.max_new_tokens={steps}"]),
                    0, frozenset())
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"peak_growth": after - before, "tokens": [len(r["completion_ids"]) for r in rows]}))
"""


def test_no_full_vocabulary_logits_history_is_kept(tmp_path):
    vocab, steps, rows = 131072, 96, 4
    history = steps * rows * vocab * 4  # every step's fp32 logits: what output_logits keeps (201 MB here)
    done = subprocess.run([sys.executable, "-c", PEAK, str(vocab), str(steps), str(TOKENIZER)], cwd=ROOT,
                          env=checkout_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["tokens"] == [steps] * rows  # every step ran (no end token)
    # A step's logits and top-k come and go; a history of them would be all of `history` at the last step.
    assert measured["peak_growth"] < history / 4, (measured, history)


@pytest.mark.slow
def test_offline_kd_trains_on_stored_topk(toy_trajectories, tmp_path):
    """A real training step whose KD losses read the stored float16 top-k (no verifier in the step)."""
    from conftest import TOY_TRAJECTORIES

    root, traj = toy_trajectories
    out = tmp_path / "kd"
    args = [f"drafter.path={root / 'ck' / 'drafter-base'}", f"verifier.path={root / 'ck' / 'verifier'}",
            f"trajectories.out={traj}", *TOY_TRAJECTORIES, f"train.out={out}", "train.gamma=4",
            "train.windows_per_sequence=2", "train.max_steps=2", "train.micro_batch_size=2", "train.eval_every=100",
            "train.final_eval_prompts=0", "train.data_mode=offline", "train.losses={streak_tv: 1.0, fkl: 1.0}"]
    done = subprocess.run([sys.executable, "align/train.py", "recipes/tiny/align.yaml", *args], cwd=ROOT,
                          env=checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 2 and all(np.isfinite(record[n]) and record[n] != 0 for n in ("streak_tv", "fkl")), record
