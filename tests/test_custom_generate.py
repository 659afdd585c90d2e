"""The exported folder's `custom_generate/generate.py`: SpecDiff decoding with transformers alone (#14 item 1).

`verifier.generate(ids, assistant_model=drafter, custom_generate=folder, trust_remote_code=True)` runs in a process
where `import align` fails, decodes exactly what `verifier.generate()` decodes greedily, and reports the τ of align's
runtime; sampled, its first tokens are distributed as the verifier's (the chi-square of test_sampling_lossless)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from align.cli import main
from align.decoding.generation import Sampling
from align.decoding.specdiff import specdiff_generate
from align.models import DrafterSpec
from test_sampling_lossless import NEW_TOKENS, PROMPT, SAMPLING, TRIALS, chi_square_pvalue, exact_joint, peaky

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "checkpoints" / "tiny"
GAMMA, MAX_NEW_TOKENS = 8, 24
PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n    def", "for i in range(", "# sort a list\ndef",
           "x = [1, 2, 3]\nprint(", "if __name__ ==", "return sum("]

# Runs in a fresh interpreter. A meta-path finder makes `import align` raise even though the venv has align installed
# (editable): whatever custom_generate/generate.py needs must come from torch and transformers.
ISOLATED = r"""
import importlib.abc, json, sys

class NoAlign(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "align" or name.startswith("align."):
            raise ImportError("align is not importable here")

sys.meta_path.insert(0, NoAlign())
try:
    import align  # noqa: F401
    sys.exit("align is importable")
except ImportError:
    pass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

folder, verifier_path, gamma, max_new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
drafter = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
verifier = AutoModelForCausalLM.from_pretrained(verifier_path, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(folder)
records = []
for prompt in json.loads(sys.stdin.read()):
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = verifier.generate(ids, assistant_model=drafter, custom_generate=folder, trust_remote_code=True,
                            max_new_tokens=max_new_tokens, gamma=gamma, return_dict_in_generate=True)
    greedy = verifier.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    records.append({"prompt_ids": ids[0].tolist(), "custom": out.sequences[0].tolist(), "greedy": greedy[0].tolist(),
                    "tau": out.tau, "accept_counts": out.accept_counts})
print(json.dumps({"records": records, "align_loaded": any(m.split(".")[0] == "align" for m in sys.modules)}))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("custom_generate")
    assert main(["export", "recipes/tiny/align.yaml", f"verifier.path={TINY / 'verifier'}",
                 f"drafter.path={TINY / 'drafter-base'}", f"export.out={tmp / 'out'}"]) == 0
    return tmp


def test_decodes_as_generate_without_align(exported):
    folder = exported / "out"
    assert (folder / "custom_generate" / "generate.py").is_file()
    # transformers copies the file into its module cache: keep that cache inside the test's folder.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(exported / "modules")}
    run = subprocess.run([sys.executable, "-c", ISOLATED, str(folder), str(TINY / "verifier"), str(GAMMA),
                          str(MAX_NEW_TOKENS)], input=json.dumps(PROMPTS), env=env, cwd=exported,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert not result["align_loaded"]
    records = result["records"]
    assert len(records) == len(PROMPTS)
    for record in records:
        assert record["custom"] == record["greedy"]
        assert len(record["custom"]) > len(record["prompt_ids"])

    # align's own runtime on the same prompts, models and γ: the same algorithm, so the same τ.
    verifier = AutoModelForCausalLM.from_pretrained(TINY / "verifier", dtype=torch.float32)
    drafter = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    spec = DrafterSpec(**drafter.config.drafter_spec)
    eos_ids = frozenset([verifier.generation_config.eos_token_id])
    align_counts, custom_counts = [], []
    for record in records:
        ids = torch.tensor([record["prompt_ids"]])
        tokens, stats = specdiff_generate(verifier, drafter, spec, ids, GAMMA, MAX_NEW_TOKENS, eos_ids=eos_ids)
        assert record["custom"] == record["prompt_ids"] + tokens
        assert record["tau"] == pytest.approx(stats.tau)
        align_counts += stats.accept_counts
        custom_counts += record["accept_counts"]
    tau = sum(n + 1 for n in custom_counts) / len(custom_counts)
    align_tau = sum(n + 1 for n in align_counts) / len(align_counts)
    assert tau == pytest.approx(align_tau, rel=0.05)


def test_refuses_what_it_cannot_decode(exported):
    from align.custom_generate import generate

    verifier = AutoModelForCausalLM.from_pretrained(TINY / "verifier", dtype=torch.float32)
    drafter = AutoModelForCausalLM.from_pretrained(exported / "out", dtype=torch.float32)
    with pytest.raises(ValueError, match="one prompt at a time"):
        generate(verifier, torch.ones(2, 3, dtype=torch.long), assistant_model=drafter, max_new_tokens=4)
    with pytest.raises(ValueError, match="repetition_penalty"):
        generate(verifier, torch.ones(1, 3, dtype=torch.long), assistant_model=drafter, max_new_tokens=4,
                 repetition_penalty=1.2)
    drafter.config.drafter_spec = {**drafter.config.drafter_spec, "kind": "dflash"}
    with pytest.raises(ValueError, match="align's runtime"):
        generate(verifier, torch.ones(1, 3, dtype=torch.long), assistant_model=drafter, max_new_tokens=4)
    with pytest.raises(ValueError, match="drafter_spec"):
        generate(verifier, torch.ones(1, 3, dtype=torch.long), assistant_model=verifier, max_new_tokens=4)


def test_sampling_is_the_verifiers_distribution(tmp_path):
    # The peaky 8-token models of test_sampling_lossless, the drafter saved with its spec beside the shipped file.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads cost more than they give
    verifier, drafter = peaky(0), peaky(1)
    verifier.generation_config.eos_token_id = None  # the table counts NEW_TOKENS tokens every time
    drafter.config.drafter_spec = DrafterSpec(7, 1, "block_causal").to_dict()
    drafter.save_pretrained(tmp_path)
    (tmp_path / "custom_generate").mkdir()
    shutil.copy2(ROOT / "align" / "custom_generate.py", tmp_path / "custom_generate" / "generate.py")
    try:
        decode = verifier.load_custom_generate(str(tmp_path), trust_remote_code=True)  # what generate() runs
        torch.manual_seed(0)
        samples = []
        for _ in range(TRIALS):
            out = decode(model=verifier, inputs=PROMPT, assistant_model=drafter, gamma=1, do_sample=True,
                         temperature=SAMPLING.temperature, top_k=SAMPLING.top_k, max_new_tokens=NEW_TOKENS)
            samples.append(out[0, PROMPT.shape[1]:].tolist())
    finally:
        torch.set_num_threads(threads)
    assert all(len(s) == NEW_TOKENS for s in samples)
    assert chi_square_pvalue(samples, exact_joint(verifier, PROMPT, Sampling(SAMPLING.temperature,
                                                                             SAMPLING.top_k))) > 1e-3


@pytest.mark.parametrize("config, ships", [
    ({"model_type": "llama", "drafter_spec": {"mask_token_id": 2}}, True),
    ({"model_type": "Dream", "auto_map": {"AutoModel": "modeling_dream.DreamModel"}, "drafter_spec": {}}, True),
    ({"model_type": "diffusion_gemma", "drafter_spec": {"noise": "uniform"}}, False),
    ({"model_type": "diffusion_gemma", "drafter_spec": {"mask_token_id": 4}}, False),
    ({"model_type": "align_dflash", "drafter_spec": {"kind": "dflash"}}, False),
])
def test_card_shows_transformers_alone_first_and_never_pip_install_align(config, ships):
    from align.config import load_recipe
    from align.export import model_card

    card = model_card(config, {}, None, load_recipe(None, []), "align export x", "ck/base")
    assert "pip install align" not in card and "from its repository" in card
    assert ("custom_generate=\"THIS_FOLDER\"" in card) == ships
    if ships:
        assert card.index("custom_generate=") < card.index("specdiff_generate")


@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_every_spec_decodes_as_align_does(tmp_path, attention, shift):
    # Each way of reading a drafter (context cache or re-encoding, shifted or not) against align's runtime: the same
    # tokens and the same accepted lengths, iteration by iteration. The drafter is the verifier's own weights, so that
    # drafts read at the right positions are often accepted (a shifted drafter's first token always is).
    verifier, drafter = peaky(0), peaky(0)
    verifier.generation_config.eos_token_id = None
    spec = DrafterSpec(7, shift, attention)
    drafter.config.drafter_spec = spec.to_dict()
    drafter.save_pretrained(tmp_path)
    (tmp_path / "custom_generate").mkdir()
    shutil.copy2(ROOT / "align" / "custom_generate.py", tmp_path / "custom_generate" / "generate.py")
    prompt = torch.tensor([[1, 5, 2, 3, 6]])
    out = verifier.generate(prompt, assistant_model=drafter, custom_generate=str(tmp_path), trust_remote_code=True,
                            max_new_tokens=20, gamma=3, return_dict_in_generate=True)
    tokens, stats = specdiff_generate(verifier, drafter, spec, prompt, 3, 20)
    assert out.sequences[0].tolist() == prompt[0].tolist() + tokens
    assert out.sequences[0].tolist() == verifier.generate(prompt, max_new_tokens=20, do_sample=False)[0].tolist()
    assert out.accept_counts == stats.accept_counts and out.tau == pytest.approx(stats.tau)
    assert shift == 0 or min(out.accept_counts[:-1]) >= 1


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_tensors_follow_the_models_device(attention):
    # As tests/test_devices.py: with `meta` as the default device, a factory call without device= makes a meta tensor
    # that fails next to the CPU models, as a CPU tensor would fail next to models on a GPU.
    from align.custom_generate import generate

    verifier, drafter = peaky(0), peaky(0)
    drafter.config.drafter_spec = DrafterSpec(7, 1, attention).to_dict()
    for sample in (False, True):
        with torch.device("meta"):
            out = generate(verifier, PROMPT, assistant_model=drafter, max_new_tokens=6, gamma=2, do_sample=sample,
                           eos_token_id=None)
        assert out.device.type == "cpu" and out.shape == (1, PROMPT.shape[1] + 6)
