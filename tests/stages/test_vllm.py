"""vLLM as align's trajectory engine and serving engine, on the shipped tiny verifier.

vLLM runs in its own environment (.venv-vllm, built by launch/setup_vllm.sh, which launch/test.sh runs first), through
align/vllm_worker.py. These tests run wherever that environment exists, and always in CI (CI=true), where a missing
environment is a failure, not a skip.
"""

import json
import os
from pathlib import Path

import pytest

from align.cli import main
from align.data import load_trajectories

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this file out; CI runs it

ROOT = Path(__file__).resolve().parents[2]
VERIFIER = ROOT / "checkpoints" / "tiny" / "verifier"
HAVE_VLLM = (ROOT / ".venv-vllm" / "bin" / "python").is_file() or bool(os.environ.get("ALIGN_VLLM_PYTHON"))
needs_vllm = pytest.mark.skipif(not HAVE_VLLM and not os.environ.get("CI"),
                                reason="no .venv-vllm (bash launch/setup_vllm.sh builds it; CI always does)")

# HumanEval-shaped prompts of different lengths, so that HF's batches are left-padded (vLLM's never are).
PROMPTS = [
    'def add(a, b):\n    """Return the sum of a and b."""\n',
    'def is_palindrome(text):\n    """Return True when text reads the same backwards."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    'def read_lines(path, encoding="utf-8"):\n    """Return the lines of the file at path, without newlines."""\n',
    "import os\n\n\ndef walk_files(root):\n",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number (fibonacci(0) == 0)."""\n    if n < 2:\n',
    "def _quote(value):\n",
    'def parse_header(line):\n    """Split a header line "Name: value" into (name, value)."""\n    name, _, value = ',
]
MAX_NEW_TOKENS = 48
TOPK = 5


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def trajectories(prompt_file, out, *extra):
    # Greedy, float32 (align's auto on a CPU), batches of 4: two chunks, each padded differently for HF.
    return main(["trajectories", "recipes/tiny/align.yaml", f"verifier.path={VERIFIER}", f"trajectories.out={out}",
                 f"data.train_prompts={prompt_file}", "trajectories.temperature=0", "trajectories.batch_size=4",
                 f"trajectories.max_new_tokens={MAX_NEW_TOKENS}", f"trajectories.store_topk={TOPK}",
                 "verifier.dtype=float32", *extra])


@pytest.fixture(scope="module")
def both_backends(prompt_file, tmp_path_factory):
    """The same greedy trajectories made by HF generate and by vLLM."""
    root = tmp_path_factory.mktemp("backends")
    assert trajectories(prompt_file, root / "hf", "trajectories.backend=hf") == 0
    assert trajectories(prompt_file, root / "vllm", "trajectories.backend=vllm") == 0
    return load_trajectories(root / "hf"), load_trajectories(root / "vllm"), root


@needs_vllm
def test_greedy_trajectories_are_token_identical(both_backends):
    hf, vllm, root = both_backends
    assert len(hf) == len(vllm) == len(PROMPTS)
    assert hf["prompt_index"] == vllm["prompt_index"] and hf["prompt_ids"] == vllm["prompt_ids"]
    assert hf["completion_ids"] == vllm["completion_ids"]
    # Not trivially equal: the verifier writes real, different continuations (some may stop at EOS).
    assert len({tuple(c) for c in vllm["completion_ids"]}) == len(PROMPTS)
    assert sum(map(len, vllm["completion_ids"])) > len(PROMPTS) * MAX_NEW_TOKENS // 2
    manifest = json.loads((root / "vllm" / "manifest.json").read_text())
    assert manifest["settings"]["backend"] == "vllm" and manifest["engine"].startswith("vllm ")
    assert json.loads((root / "hf" / "manifest.json").read_text())["settings"]["backend"] == "hf"


@needs_vllm
def test_topk_logprobs_agree(both_backends):
    hf, vllm, _ = both_backends
    for hf_row, vllm_row in zip(hf, vllm):
        assert len(vllm_row["topk_ids"]) == len(vllm_row["completion_ids"])
        for hf_ids, hf_lp, ids, lp in zip(hf_row["topk_ids"], hf_row["topk_logprobs"], vllm_row["topk_ids"],
                                          vllm_row["topk_logprobs"]):
            assert lp == sorted(lp, reverse=True)  # best first, as HF's topk
            # The same tokens (two within float noise of each other may swap places) with the same log-probs.
            assert sorted(hf_ids) == sorted(ids) or hf_ids[0] == ids[0]
            assert lp == pytest.approx(hf_lp, abs=2e-3, rel=2.0 ** -10)  # both stored as float16


@needs_vllm
def test_sampled_trajectories_keep_each_completion_with_its_prompt(prompt_file, tmp_path):
    out = tmp_path / "sampled"
    assert trajectories(prompt_file, out, "trajectories.backend=vllm", "trajectories.temperature=1.0",
                        "trajectories.completions_per_prompt=3", "trajectories.max_new_tokens=12",
                        "trajectories.store_topk=0") == 0
    data = load_trajectories(out)
    assert len(data) == 3 * len(PROMPTS)
    assert data["prompt_index"] == [i for i in range(len(PROMPTS)) for _ in range(3)]
    for i in range(len(PROMPTS)):
        rows = data.select(range(3 * i, 3 * i + 3))
        assert len({tuple(ids) for ids in rows["prompt_ids"]}) == 1  # the prompt they continue
        assert len({tuple(c) for c in rows["completion_ids"]}) == 3  # three samples, three seeds
    assert "topk_ids" not in data.column_names


@needs_vllm
def test_serve_without_a_drafter_decodes_as_hf(both_backends):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from align.vllm_engine import serve

    hf, _, _ = both_backends
    tokenizer = AutoTokenizer.from_pretrained(VERIFIER)
    prompt_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS[:4]]
    # The tiny verifier rarely ends a completion within a few dozen tokens, so a token from the middle of the first
    # greedy completion stands in for EOS: decoding must stop at it, keeping it, as generate() does.
    stop = hf["completion_ids"][0][MAX_NEW_TOKENS // 3]
    result, batched = serve(str(VERIFIER), prompt_ids, max_new_tokens=MAX_NEW_TOKENS, dtype="float32",
                            kv_cache_gib=0.25, stop_token_ids=[stop], concurrency=(1, 4))
    # 4 requests in flight: the same prompts in one batch, measured on the same engine.
    assert (result.concurrency, batched.concurrency) == (1, 4) and len(batched.outputs) == len(prompt_ids)
    assert batched.num_drafts == 0 and batched.tokens_per_second > 0
    verifier = AutoModelForCausalLM.from_pretrained(VERIFIER, dtype=torch.float32).eval()
    for ids, served in zip(prompt_ids, result.outputs):
        with torch.inference_mode():  # batch 1, no padding: HF's plainest greedy decoding
            out = verifier.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                                    eos_token_id=stop, pad_token_id=tokenizer.pad_token_id)
        assert served == out[0, len(ids):].tolist()
    assert result.outputs[0][-1] == stop and len(result.outputs[0]) <= MAX_NEW_TOKENS // 3 + 1
    # No drafter: no drafts, one token per forward, and a throughput.
    assert result.num_drafts == 0 and result.mean_acceptance_length == 1.0
    assert result.tokens_per_second > 0 and result.vllm_version


@needs_vllm
def test_a_drafter_vllm_cannot_load_is_named_in_one_line(tmp_path):
    from align.vllm_engine import VllmRunner

    missing = tmp_path / "no-drafter"
    with pytest.raises(RuntimeError) as error:
        VllmRunner(str(VERIFIER), dtype="float32", kv_cache_gib=0.25,
                   speculative_config={"model": str(missing), "num_speculative_tokens": 4})
    message = str(error.value)
    assert "\n" not in message and str(missing) in message and "log:" in message


def test_vllm_backend_without_its_environment_is_refused(prompt_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ALIGN_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    assert trajectories(prompt_file, tmp_path / "out", "trajectories.backend=vllm") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "trajectories.backend" in err and "setup_vllm.sh" in err
    assert not (tmp_path / "out").exists()  # refused before any work


@needs_vllm
def test_vllm_trajectories_stop_where_eval_greedy_stops(prompt_file, tmp_path):
    """A verifier whose generation_config ends generations at a token other than the tokenizer's eos (an instruct
    model's end-of-turn token): vLLM's completions stop there, token for token where eval's AR greedy stops."""
    import shutil

    import torch
    from transformers import AutoTokenizer

    from align.recipe_files import load_recipe
    from align.data import eos_token_ids
    from align.decoding.ar import ar_generate
    from align.decoding.generation import Sampling
    from align.models import load_verifier

    tokenizer = AutoTokenizer.from_pretrained(VERIFIER)
    prompt_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS]
    folder = tmp_path / "verifier"
    shutil.copytree(VERIFIER, folder)
    verifier = load_verifier(load_recipe(None, [f"verifier.path={folder}", "verifier.dtype=float32"]).verifier)
    first = ar_generate(verifier, torch.tensor([prompt_ids[0]]), MAX_NEW_TOKENS, Sampling(),
                        frozenset({tokenizer.eos_token_id}))[0]
    stop_at = next(i for i in range(1, MAX_NEW_TOKENS - 1) if first[i] not in first[:i] + [tokenizer.eos_token_id])
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [first[stop_at]]}))
    verifier.generation_config.eos_token_id = [first[stop_at]]  # as from_pretrained would now read it
    assert trajectories(prompt_file, tmp_path / "out", f"verifier.path={folder}", "trajectories.backend=vllm",
                        "trajectories.store_topk=0") == 0
    rows = load_trajectories(tmp_path / "out")
    eval_ids = eos_token_ids(verifier, tokenizer)
    assert rows["completion_ids"] == [ar_generate(verifier, torch.tensor([ids]), MAX_NEW_TOKENS, Sampling(),
                                                  eval_ids)[0] for ids in prompt_ids]
    assert rows["completion_ids"][0] == first[: stop_at + 1]  # stopped at the end-of-turn token, which is kept
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["end_token_ids"] == sorted(eval_ids) == sorted({tokenizer.eos_token_id, first[stop_at]})
