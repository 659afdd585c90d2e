"""The shipped tiny family loads with plain transformers in a fresh, offline process and writes Python."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this file out; CI runs it

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "checkpoints" / "tiny"
PARTS = ("tokenizer", "verifier", "drafter-base", "ar-drafter")

# Runs in a separate interpreter so that nothing imported or cached by the test session can help it.
FRESH = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tiny, prompt = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(f"{tiny}/tokenizer")
models = {p: AutoModelForCausalLM.from_pretrained(f"{tiny}/{p}") for p in ("verifier", "drafter-base", "ar-drafter")}
ids = tokenizer(prompt, return_tensors="pt").input_ids
out = models["verifier"].generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.pad_token_id)
print(json.dumps({
    "completion": tokenizer.decode(out[0, ids.shape[1]:]),
    "vocab": {p: m.config.vocab_size for p, m in models.items()},
    "drafter_spec": models["drafter-base"].config.drafter_spec,
    "mask_token_id": tokenizer.mask_token_id,
}))
"""


def test_manifests_describe_each_part():
    for part in PARTS:
        manifest = json.loads((TINY / part / "manifest.json").read_text())
        assert manifest["part"] == part
        assert manifest["command"].startswith("align bootstrap recipes/tiny/bootstrap.yaml")
        assert len(manifest["corpus_hash"]) == 64
        if part != "tokenizer":
            assert manifest["parameters"] > 1e6 and manifest["tokens_seen"] > 1e5 and manifest["wall_time_s"] > 60
    # Size ordering the speedup depends on: the verifier costs several drafters.
    sizes = {p: json.loads((TINY / p / "manifest.json").read_text())["parameters"] for p in PARTS[1:]}
    assert sizes["verifier"] > 4 * sizes["drafter-base"] and sizes["drafter-base"] == sizes["ar-drafter"]


def test_family_loads_offline_in_a_fresh_process_and_writes_python():
    prompt = 'def mean(values):\n    """Return the arithmetic mean of a non-empty list of numbers."""\n'
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", FRESH, str(TINY), prompt], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(set(out["vocab"].values())) == 1  # one shared vocabulary
    assert out["drafter_spec"] == {"mask_token_id": out["mask_token_id"], "logits_shift": 0, "attention": "block_causal",
                                   "noise": "mask", "noise_seed": 0, "kind": "standalone"}
    completion = out["completion"]
    # Recognisably Python: keywords, indentation and the code shapes of the standard library.
    assert sum(word in completion for word in ("def ", "return", "self", '"""', "if ", " = ", "import")) >= 3, completion
    assert any(line.startswith("    ") for line in completion.splitlines()), completion
