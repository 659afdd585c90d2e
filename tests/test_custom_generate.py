"""The exported folder's `custom_generate/generate.py`: SpecDiff decoding with transformers alone (#14 item 1).

`verifier.generate(ids, assistant_model=drafter, custom_generate=folder, trust_remote_code=True)` runs in a process
where `import align` fails, decodes exactly what `verifier.generate()` decodes greedily, and reports the τ of align's
runtime; sampled, its first tokens are distributed as the verifier's (the power-tested chi-square of
test_sampling_lossless, on full-attention and sliding-window verifiers). Every setting of generate() it takes means
what it means in generate() (the same support and distributions sampled, the same tokens greedy, with each logits
processor), and what it cannot reproduce is refused by name (#22 defect 3)."""

import copy
import json
import os
import shutil
import subprocess
import sys
from importlib import import_module
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from align.cli import main
from align.decoding.ar import ar_generate
from align.decoding.generation import Sampling
from align.decoding.specdiff import specdiff_generate
from align.drafters.spec import DrafterSpec
from test_sampling_lossless import (ALPHA, DECODES, NEW_TOKENS, PROMPT, SEED, TABLE_PROMPT, TEMPERATURE, VERIFIER_KINDS,
                                    exact_joint, lossless_pvalue, peaky, transformer_setup)
from test_verifier_families import FAMILIES, MASK as FAMILY_MASK, SLIDING_WINDOW, peaky as family_model

ROOT = Path(__file__).resolve().parents[1]
# The file `align export` ships, from the align imported (as export.py copies it): a mutant copy's, under
# tests/test_mutations.py.
SHIPPED = Path(import_module("align.custom_generate").__file__)
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


@pytest.mark.slow
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


def test_refuses_drafters_it_cannot_read(exported):
    from align.custom_generate import generate

    verifier = AutoModelForCausalLM.from_pretrained(TINY / "verifier", dtype=torch.float32)
    drafter = AutoModelForCausalLM.from_pretrained(exported / "out", dtype=torch.float32)
    with pytest.raises(ValueError, match="one prompt at a time"):
        generate(verifier, torch.ones(2, 3, dtype=torch.long), assistant_model=drafter, max_new_tokens=4)
    drafter.config.drafter_spec = {**drafter.config.drafter_spec, "kind": "dflash"}
    with pytest.raises(ValueError, match="align's runtime"):
        generate(verifier, torch.ones(1, 3, dtype=torch.long), assistant_model=drafter, max_new_tokens=4)
    with pytest.raises(ValueError, match="drafter_spec"):
        generate(verifier, torch.ones(1, 3, dtype=torch.long), assistant_model=verifier, max_new_tokens=4)


# The sliding-window kinds cost ~15 s each and verify as the full-attention one does (the model's own masks over a
# cropped cache, which test_sampling_lossless's sliding tests check for specdiff): marked slow.
@pytest.mark.parametrize("kind, union", [
    (kind, union) if kind == "llama" and not union else pytest.param(kind, union, marks=pytest.mark.slow)
    for union in (False, True) for kind in VERIFIER_KINDS], ids=lambda v: {True: "union", False: "chain"}.get(v, v))
def test_sampling_is_the_verifiers_distribution(tmp_path, kind, union):
    """Through what generate(custom_generate=folder) runs (`load_custom_generate`), on a transformer verifier with full
    attention, one whose every layer slides (`sliding_window` alone) and one with `layer_types` (a sliding and a full
    layer), all spread out, decoded past the window, with the table drafter of test_sampling_lossless (a spread-out q
    of its own: drafts are rejected and residuals drawn) at γ 2. Temperature 0.9, 1,000 decodes: a marginal deviation
    of w ≥ 0.231 (a 0.093 shift of a probability of 0.2) and a joint one of w ≥ 0.32 are detected at α = 1e-4 with
    power 0.99 (test_sampling_lossless's power test). union: the same through the union tree's point-mass walk, whose
    tree forward masks each node's window over the cached prefix and whose kept branch moves keys in the cache."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads cost more than they give
    setup = transformer_setup(kind)
    setup.drafter.config.drafter_spec = setup.spec.to_dict()
    (tmp_path / "custom_generate").mkdir()
    shutil.copy2(SHIPPED, tmp_path / "custom_generate" / "generate.py")
    try:
        decode = setup.verifier.load_custom_generate(str(tmp_path), trust_remote_code=True)  # what generate() runs
        torch.manual_seed(SEED)  # generate() samples from the global generator
        samples = []
        for _ in range(DECODES):
            out = decode(model=setup.verifier, inputs=TABLE_PROMPT, assistant_model=setup.drafter, gamma=2,
                         do_sample=True, temperature=TEMPERATURE.temperature, max_new_tokens=NEW_TOKENS, union=union)
            samples.append(out[0, TABLE_PROMPT.shape[1]:].tolist())
    finally:
        torch.set_num_threads(threads)
    assert all(len(s) == NEW_TOKENS for s in samples)
    assert lossless_pvalue(samples, exact_joint(setup.verifier, TABLE_PROMPT, TEMPERATURE)) > ALPHA


@pytest.mark.parametrize("config, ships", [
    ({"model_type": "llama", "drafter_spec": {"mask_token_id": 2}}, True),
    ({"model_type": "Dream", "auto_map": {"AutoModel": "modeling_dream.DreamModel"}, "drafter_spec": {}}, True),
    ({"model_type": "diffusion_gemma", "drafter_spec": {"noise": "uniform"}}, False),
    ({"model_type": "diffusion_gemma", "drafter_spec": {"mask_token_id": 4}}, False),
    ({"model_type": "align_dflash", "drafter_spec": {"kind": "dflash"}}, False),
])
def test_card_shows_transformers_alone_first_and_never_pip_install_align(config, ships):
    from align.recipe_files import load_recipe
    from align.cards import model_card

    card = model_card(config, {}, None, load_recipe(None, []), "align export x", "ck/base")
    assert "pip install align" not in card and "from its repository" in card
    assert ("custom_generate=\"THIS_FOLDER\"" in card) == ships
    if ships:
        assert card.index("custom_generate=") < card.index("specdiff_generate")


@pytest.mark.slow
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
    shutil.copy2(SHIPPED, tmp_path / "custom_generate" / "generate.py")
    prompt = torch.tensor([[1, 5, 2, 3, 6]])
    out = verifier.generate(prompt, assistant_model=drafter, custom_generate=str(tmp_path), trust_remote_code=True,
                            max_new_tokens=20, gamma=3, return_dict_in_generate=True)
    tokens, stats = specdiff_generate(verifier, drafter, spec, prompt, 3, 20)
    assert out.sequences[0].tolist() == prompt[0].tolist() + tokens
    assert out.sequences[0].tolist() == verifier.generate(prompt, max_new_tokens=20, do_sample=False)[0].tolist()
    assert out.accept_counts == stats.accept_counts and out.tau == pytest.approx(stats.tau)
    assert shift == 0 or min(out.accept_counts[:-1]) >= 1


def test_num_assistant_tokens_is_the_draft_length():
    """Assisted generation's name for the draft length is honoured (it was ignored: τ unchanged at 4, issue 36); given
    with a different gamma, or with a schedule this loop does not follow, it is refused by name."""
    from align.custom_generate import generate

    verifier, drafter = peaky(0), peaky(1)
    verifier.generation_config.eos_token_id = None
    drafter.config.drafter_spec = DrafterSpec(7, 1, "block_causal").to_dict()
    prompt = torch.tensor([[1, 5, 2, 3, 6]])
    verified = []  # tokens each verifier forward after the prefill reads: the draft and the token before it
    hook = verifier.register_forward_pre_hook(
        lambda module, args, kwargs: verified.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    lengths = {}
    try:
        for given in ({}, {"num_assistant_tokens": 3}, {"gamma": 3}):
            verified.clear()
            generate(verifier, prompt, assistant_model=drafter, max_new_tokens=24, **given)
            lengths[tuple(given.items())] = max(verified[1:])
    finally:
        hook.remove()
    assert lengths == {(): 9, (("num_assistant_tokens", 3),): 4, (("gamma", 3),): 4}
    with pytest.raises(ValueError, match="give one"):
        generate(verifier, prompt, assistant_model=drafter, gamma=3, num_assistant_tokens=2)
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule='heuristic'"):
        generate(verifier, prompt, assistant_model=drafter, num_assistant_tokens_schedule="heuristic")


@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("family", ["mistral_sliding", "qwen2_sliding"])
def test_a_sliding_window_drafter_decodes_as_align_does(family, shift):
    # #22 defect 4 in this file: a block-causal drafter whose layers slide (Mistral: `sliding_window` alone; Qwen2:
    # `layer_types`) gets only the window's keys from its context cache once the context passes the window, and its
    # block mask, sized cached + rows, crashed there (size mismatch). Sized and windowed as align's runtime masks it
    # (masks.attention_masks, which tests/test_models.py checks against the model's own forward), it drafts what
    # align drafts: the same tokens and the same accepted lengths, iteration by iteration. The drafter is the
    # verifier's own weights (so the verifier slides too), so that drafts read right are often accepted.
    from align.custom_generate import generate

    drafter, verifier = family_model(FAMILIES[family], 9), family_model(FAMILIES[family], 9)
    spec = DrafterSpec(FAMILY_MASK, shift, "block_causal")
    drafter.config.drafter_spec = spec.to_dict()
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    out = generate(verifier, prompt, assistant_model=drafter, max_new_tokens=40, gamma=4, eos_token_id=None,
                   return_dict_in_generate=True)
    tokens, stats = specdiff_generate(verifier, drafter, spec, prompt, 4, 40)
    assert prompt.shape[1] + len(tokens) > 2 * SLIDING_WINDOW  # the drafter's context went past its window
    assert out.sequences[0].tolist() == prompt[0].tolist() + tokens
    assert tokens == ar_generate(verifier, prompt, 40)[0]
    assert out.accept_counts == stats.accept_counts
    assert shift == 0 or min(out.accept_counts[:-1]) >= 1  # a shifted drafter's first token is the verifier's


def test_a_drafter_whose_masks_it_cannot_build_is_refused_before_any_work():
    from align.custom_generate import generate

    drafter = family_model(FAMILIES["qwen2"], 0)
    drafter.config.layer_types = ["chunked_attention"] * 2
    drafter.config.drafter_spec = DrafterSpec(FAMILY_MASK, 1, "block_causal").to_dict()
    with pytest.raises(ValueError, match="chunked_attention") as refused:
        generate(family_model(FAMILIES["llama"], 1), torch.tensor([[1, 2]]), assistant_model=drafter,
                 max_new_tokens=4)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_tensors_follow_the_models_device(attention):
    # As tests/test_devices.py: with `meta` as the default device, a factory call without device= makes a meta tensor
    # that fails next to the CPU models, as a CPU tensor would fail next to models on a GPU.
    from align.custom_generate import generate

    verifier, drafter = peaky(0), peaky(0)
    drafter.config.drafter_spec = DrafterSpec(7, 1, attention).to_dict()
    for sample in (False, True):
        for union in (False, True):
            with torch.device("meta"):
                out = generate(verifier, PROMPT, assistant_model=drafter, max_new_tokens=6, gamma=2,
                               do_sample=sample, eos_token_id=None, union=union)
            assert out.device.type == "cpu" and out.shape == (1, PROMPT.shape[1] + 6)


# --------------------------------------------------------------------------------------------------------------------
# every setting of generate() means here what it means in generate() (#22 defect 3)
# --------------------------------------------------------------------------------------------------------------------
SPREAD_VOCAB, SPREAD_MASK = 64, 63
SPREAD_PROMPTS = [[1, 5, 2], [3, 9, 4, 7], [12, 40, 7, 7, 2], [60, 1]]
SAMPLES = 200


def spread(seed):
    """A random 1-layer Llama over 64 tokens whose next-token distributions are spread out (top token ≈ 0.05, about
    13% of the mass outside the top 50): truncations and cutoffs remove mass a few hundred draws see."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=SPREAD_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=96)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def spread_pair():
    """(verifier, drafter): a drafter with its own spread-out q, so that drafts are rejected and residuals drawn."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads cost more than they give
    verifier, drafter = spread(0), spread(1)
    drafter.config.drafter_spec = DrafterSpec(SPREAD_MASK, 1, "block_causal").to_dict()
    yield verifier, drafter
    torch.set_num_threads(threads)


@torch.inference_mode()
def generate_distributions(verifier, prefixes: list[list[int]], setting: dict) -> torch.Tensor:
    """(len(prefixes), V): the distribution generate(do_sample=True) draws the token after each prefix from (its own
    processed scores, output_scores=True), prefixes all of one length."""
    ids = torch.tensor(prefixes)
    # An explicit mask: generate() would otherwise mask the prefixes' tokens equal to pad_token_id.
    out = verifier.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=1,
                            output_scores=True, return_dict_in_generate=True, pad_token_id=0, **setting)
    return torch.softmax(out.scores[0].float(), dim=-1)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of counts (V,) under probs (V,); 0 when a token of probability 0 was drawn. Cells are pooled, the least
    likely first, into groups expecting at least 5 draws each, so that the chi-square approximation holds."""
    counts, expected = counts.double(), probs.double() * counts.sum()
    if counts[expected == 0].sum() > 0:
        return 0.0
    obs, exp, pooled_obs, pooled_exp = [], [], 0.0, 0.0
    for i in expected.argsort().tolist():
        if expected[i] == 0:
            continue
        pooled_obs, pooled_exp = pooled_obs + float(counts[i]), pooled_exp + float(expected[i])
        if pooled_exp >= 5:
            obs.append(pooled_obs), exp.append(pooled_exp)
            pooled_obs = pooled_exp = 0.0
    if pooled_exp > 0:  # the remainder joins the last group
        obs[-1], exp[-1] = obs[-1] + pooled_obs, exp[-1] + pooled_exp
    obs_t, exp_t = torch.tensor(obs), torch.tensor(exp)
    stat = ((obs_t - exp_t) ** 2 / exp_t).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2.0), stat / 2))


# Each setting alone (with generate()'s defaults for the rest: top_k 50 when unset, temperature 1). Those after the
# first five read the tokens before the position: they must be applied after each draft position's own prefix.
SAMPLED_SETTINGS = [
    {}, {"temperature": 0.7, "top_k": 10}, {"top_p": 0.6}, {"min_p": 0.5}, {"typical_p": 0.5},
    {"epsilon_cutoff": 0.02}, {"eta_cutoff": 0.02}, {"top_k": None, "top_p": 0.9, "temperature": 1.3},
    {"repetition_penalty": 3.0}, {"no_repeat_ngram_size": 1}, {"bad_words_ids": [[5], [9, 10], [2]]},
]


@pytest.mark.slow
@pytest.mark.parametrize("union", [False, True], ids=["chain", "union"])
@pytest.mark.parametrize("setting", SAMPLED_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or
                         "defaults")
def test_sampling_draws_what_generate_draws(spread_pair, setting, union):
    # 200 decodes of 3 tokens with γ = 2: t1 from the prefill, t2 and t3 through the draft's acceptance, residual or
    # bonus. Every token must lie where generate() puts mass after its prefix (a truncation or cutoff that is not
    # applied, or applied at the wrong position, shows there: the default top_k=50 alone leaves ~13% of the mass out,
    # so 200 draws see it); the first and second tokens' distributions must be generate()'s (chi-square: it detects
    # a shift of ~0.1 in total variation at these sizes).
    from align.custom_generate import generate

    verifier, drafter = spread_pair
    prompt = torch.tensor([SPREAD_PROMPTS[0]])
    torch.manual_seed(0)
    samples = [generate(verifier, prompt, assistant_model=drafter, gamma=2, max_new_tokens=3, do_sample=True,
                        union=union, **setting)[0, prompt.shape[1]:].tolist() for _ in range(SAMPLES)]
    assert all(len(s) == 3 for s in samples)
    if setting.get("no_repeat_ngram_size") == 1:  # no token twice, prompt included
        assert all(len(set(SPREAD_PROMPTS[0] + s)) == len(SPREAD_PROMPTS[0]) + 3 for s in samples)
    first = generate_distributions(verifier, [SPREAD_PROMPTS[0]], setting)[0]
    seconds = generate_distributions(verifier, [SPREAD_PROMPTS[0] + [t] for t in range(SPREAD_VOCAB)], setting)
    pairs = sorted({tuple(s[:2]) for s in samples})
    thirds = dict(zip(pairs, generate_distributions(verifier, [SPREAD_PROMPTS[0] + list(p) for p in pairs], setting)))
    outside = [s for s in samples if first[s[0]] == 0 or seconds[s[0], s[1]] == 0 or thirds[tuple(s[:2])][s[2]] == 0]
    assert outside == [], f"{len(outside)} of {SAMPLES} decodes drew a token generate() never draws there"
    counts = torch.zeros(2, SPREAD_VOCAB)
    for s in samples:
        counts[0, s[0]] += 1
        counts[1, s[1]] += 1
    assert chi_square(counts[0], first) > 1e-3
    assert chi_square(counts[1], first @ seconds) > 1e-3


def test_sampling_by_the_models_generation_config(spread_pair):
    # What the verifier's generation_config says (a checkpoint's generation_config.json) applies as in generate().
    from align.custom_generate import generate

    verifier, drafter = spread_pair
    verifier = copy.deepcopy(verifier)
    verifier.generation_config.do_sample, verifier.generation_config.min_p = True, 0.5
    prompt = torch.tensor([SPREAD_PROMPTS[1]])
    allowed = generate_distributions(verifier, [SPREAD_PROMPTS[1]], {})[0] > 0
    assert 0 < int(allowed.sum()) < SPREAD_VOCAB / 2
    torch.manual_seed(1)
    firsts = [int(generate(verifier, prompt, assistant_model=drafter, max_new_tokens=1)[0, -1]) for _ in range(100)]
    assert all(allowed[t] for t in firsts)


def forbid_after(batch_id: int, ids: torch.Tensor) -> list[int]:
    """prefix_allowed_tokens_fn: the tokens whose sum with the last one is a multiple of 3."""
    return [t for t in range(SPREAD_VOCAB) if (t + int(ids[-1])) % 3 == 0]


GREEDY_SETTINGS = [
    {}, {"no_max_new_tokens": True}, {"max_length": 15}, {"repetition_penalty": 1.8}, {"no_repeat_ngram_size": 2},
    {"bad_words_ids": [[5], [9, 10]]}, {"suppress_tokens": [0, 1, 2, 3], "begin_suppress_tokens": [4, 5, 6]},
    {"sequence_bias": {(7,): 4.0, (8, 9): 10.0}}, {"min_new_tokens": 12}, {"forced_eos_token_id": 11},
    {"exponential_decay_length_penalty": (4, 1.6)}, {"prefix_allowed_tokens_fn": forbid_after},
    {"renormalize_logits": True, "remove_invalid_values": True},
]


@pytest.mark.slow
@pytest.mark.parametrize("union", [False, True], ids=["chain", "union"])
@pytest.mark.parametrize("own_drafter", [True, False], ids=["accepting-drafter", "rejected-drafter"])
@pytest.mark.parametrize("setting", GREEDY_SETTINGS, ids=lambda s: ",".join(s) or "defaults")
def test_greedy_is_generates_greedy_with_every_processor(spread_pair, tmp_path_factory, setting, own_drafter, union):
    # Through verifier.generate(custom_generate=folder) itself: generate()'s argument passing, then generate()'s own
    # processors applied at every draft position. Token 11 ends a sequence, so that the processors that read the end
    # token (min_new_tokens, forced_eos_token_id, exponential_decay_length_penalty) act.
    verifier, drafter = spread_pair
    verifier = copy.deepcopy(verifier)
    verifier.generation_config.eos_token_id = 11
    if own_drafter:  # the verifier's own weights: its drafts are mostly accepted, so positions 1.. are verified
        drafter = copy.deepcopy(verifier)
        drafter.config.drafter_spec = DrafterSpec(SPREAD_MASK, 1, "block_causal").to_dict()
    folder = tmp_path_factory.getbasetemp() / ("spread-own" if own_drafter else "spread-other")
    if not folder.exists():
        drafter.save_pretrained(folder)
        (folder / "custom_generate").mkdir()
        shutil.copy2(SHIPPED, folder / "custom_generate" / "generate.py")
    setting = dict(setting)
    length = {} if setting.pop("no_max_new_tokens", False) or "max_length" in setting else {"max_new_tokens": 24}
    drafted = 0
    for ids in SPREAD_PROMPTS:
        prompt = torch.tensor([ids])
        out = verifier.generate(prompt, assistant_model=drafter, custom_generate=str(folder), trust_remote_code=True,
                                gamma=4, return_dict_in_generate=True, union=union, **length, **setting)
        plain = verifier.generate(prompt, do_sample=False, **length, **setting)
        assert out.sequences[0].tolist() == plain[0].tolist()
        drafted += sum(out.accept_counts)
    if not length and "max_length" not in setting:  # generate()'s default: 20 new tokens
        assert plain.shape[1] - prompt.shape[1] == 20
    assert drafted > 0 or not own_drafter


@pytest.mark.parametrize("setting, name", [
    ({"num_beams": 2}, "beam search"), ({"num_return_sequences": 2, "do_sample": True}, "num_return_sequences"),
    ({"penalty_alpha": 0.6, "top_k": 4}, "contrastive search"), ({"dola_layers": "high"}, "dola"),
    ({"guidance_scale": 1.5}, "guidance_scale"), ({"stop_strings": ["x"]}, "stop_strings"),
    ({"max_time": 5.0}, "max_time"), ({"token_healing": True}, "token_healing"),
    ({"prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens"),
    ({"output_scores": True, "return_dict_in_generate": True}, "output_scores"),
    ({"output_logits": True, "return_dict_in_generate": True}, "output_logits"),
    ({"logits_processor": "processor"}, "logits_processor"), ({"stopping_criteria": "criterion"}, "stopping_criteria"),
    ({"streamer": object()}, "streamer"), ({"negative_prompt_ids": torch.ones(1, 2, dtype=torch.long)},
                                          "negative_prompt_ids"),
    ({"assistant_tokenizer": object()}, "assistant_tokenizer"), ({"top_kk": 3}, "top_kk"),
    ({"watermarking_config": "watermark"}, "watermarking_config"),
])
def test_what_it_cannot_reproduce_is_refused_by_name(spread_pair, setting, name):
    from transformers import LogitsProcessorList, StoppingCriteriaList, TemperatureLogitsWarper, WatermarkingConfig
    from transformers.generation import MaxLengthCriteria

    from align.custom_generate import generate

    verifier, drafter = spread_pair
    made = {"processor": LogitsProcessorList([TemperatureLogitsWarper(0.5)]),
            "criterion": StoppingCriteriaList([MaxLengthCriteria(8)]), "watermark": WatermarkingConfig()}
    setting = {k: made.get(v, v) if isinstance(v, str) else v for k, v in setting.items()}
    with pytest.raises(ValueError, match=name.replace(" ", ".")) as refused:
        generate(verifier, torch.tensor([SPREAD_PROMPTS[0]]), assistant_model=drafter, max_new_tokens=4, **setting)
    assert "\n" not in str(refused.value)
