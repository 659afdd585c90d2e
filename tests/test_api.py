"""The Python API (align/api.py, #14 item 4): `align.load(...)` then `pair.generate(prompts, method=...)`, on the
shipped tiny family. Greedy results are the verifier's own with every method; generations end at the verifier's end
tokens by default; the README's example runs as written."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import checkout_env

import align
from align.config import RecipeError
from align.data import render_prompt
from align.methods import DFLASH_METHODS, METHODS
from test_chat_data import TEMPLATE, with_template

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "checkpoints" / "tiny"
VERIFIER, DRAFTER, AR_DRAFTER = (str(TINY / name) for name in ("verifier", "drafter-base", "ar-drafter"))
PROMPTS = ["def add(a, b):", "class Stack:\n    def"]
NEW_TOKENS = 24


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def proxy_corpus(tmp_path_factory) -> dict[str, str]:
    """A small JSONL text corpus for the CPS proxy, and a data_dir to cache it in: nothing is written in the repo."""
    folder = tmp_path_factory.mktemp("proxy")
    texts = [path.read_text() for path in sorted((ROOT / "align" / "decoding").glob("*.py"))]
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return {"cps_proxy_corpus": str(folder / "corpus.jsonl"), "data_dir": str(folder / "data")}


@pytest.fixture(scope="module")
def pair(proxy_corpus):
    return align.load(verifier=VERIFIER, drafter=DRAFTER, ar_drafter=AR_DRAFTER, **proxy_corpus)


def linked_copy(source: Path, dest: Path) -> Path:
    """A copy of a model folder whose weights are linked, not copied."""
    dest.mkdir(parents=True)
    for f in source.iterdir():
        (dest / f.name).symlink_to(f) if f.name == "model.safetensors" else shutil.copy2(f, dest / f.name)
    return dest


def verifier_greedy(pair, prompt_ids: list[int], eos: list[int]) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = pair.verifier.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos or None,
                                 pad_token_id=pair.tokenizer.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.slow
def test_import_align_stays_cheap():
    code = ("import sys, align\nassert 'torch' not in sys.modules, 'import align imported torch'\n"
            "assert callable(align.load) and 'torch' in sys.modules\nprint(sorted(set(dir(align)) & {'load', 'Pair'}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=checkout_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['Pair', 'load']"


@pytest.mark.slow
def test_greedy_results_of_every_method_are_the_verifiers_own(pair, toy_trajectories):
    assert pair.methods == tuple(METHODS)  # all three models loaded: every method runs
    reference = pair.generate(PROMPTS, method="ar", max_new_tokens=NEW_TOKENS)
    for result in reference:
        assert result.token_ids == verifier_greedy(pair, result.prompt_token_ids, sorted(pair.eos_token_ids))
        assert len(result.token_ids) == NEW_TOKENS and result.finish_reason == "length"
        assert result.text == pair.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    for method in METHODS:
        # SuffixDecoding drafts from a trajectories folder (the toy verifier's own completions)
        extra = {"suffix_corpus": str(toy_trajectories[1])} if "suffix" in method else {}
        results = pair.generate(PROMPTS, method=method, max_new_tokens=NEW_TOKENS, **extra)
        assert [r.token_ids for r in results] == [r.token_ids for r in reference], method
        assert [r.text for r in results] == [r.text for r in reference], method
        assert [r.prompt for r in results] == PROMPTS
        if method.startswith("specdiff") or method == "sd_ar":
            assert all(r.stats.tau > 1 for r in results), (method, [r.stats.tau for r in results])


@pytest.mark.slow
def test_the_tau_of_hf_methods_is_the_one_align_eval_reports(pair):
    # HF's generate, assisted generation and prompt lookup report forward counts only: τ is (new − 1) / forwards,
    # as eval.json has it (the shared mean_accepted_length), not 1.0. A repeating prompt makes prompt lookup's drafts
    # land, so that its τ is above 1.
    from align.decoding.generation import mean_accepted_length

    repeating = "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2, 3]\nw = [1, 2, 3]\n"
    for method in ("hf_generate", "hf_assisted", "prompt_lookup", "ar", "specdiff"):
        results = pair.generate([repeating, *PROMPTS], method=method, max_new_tokens=NEW_TOKENS)
        for r in results:
            if method in ("hf_generate", "hf_assisted", "prompt_lookup", "ar"):
                assert r.stats.tau == pytest.approx((len(r.token_ids) - 1) / r.stats.verifier_forwards), method
            assert r.stats.tau == mean_accepted_length([r.stats])
        if method in ("prompt_lookup", "hf_assisted"):
            assert results[0].stats.tau > 1, (method, results[0].stats)


def test_settings_come_from_the_schema_and_are_checked(pair):
    from align.config import DecodeSection

    assert pair.recipe.decode == DecodeSection(cps_proxy_corpus=pair.recipe.decode.cps_proxy_corpus)
    assert pair.verifier.dtype == torch.float32  # dtype "device" (the default) on a CPU
    default = pair.generate("def add(a, b):", method="ar")
    assert len(default) == 1 and len(default[0].token_ids) == DecodeSection().max_new_tokens
    with pytest.raises(RecipeError, match=r"^unknown setting 'max_new_token' \(did you mean 'max_new_tokens'\?\)$"):
        pair.generate(PROMPTS, max_new_token=8)
    with pytest.raises(RecipeError, match=r"^decode\.gamma: Input should be greater than or equal to 1 \(got 0\)$"):
        pair.generate(PROMPTS, gamma=0)


def test_a_batch_gives_each_prompt_what_it_gives_alone(pair):
    # text, token ids and a single prompt given bare all read the same
    ids = pair.generate("def add(a, b):", method="ar", max_new_tokens=4)[0].prompt_token_ids
    batch = pair.generate(["import os\n", ids, "def fib(n):"], method="specdiff", max_new_tokens=12)
    alone = [pair.generate(p, method="specdiff", max_new_tokens=12)[0] for p in (["import os\n"], ids, "def fib(n):")]
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    assert batch[1].prompt_token_ids == ids and batch[1].prompt == ids


def test_seeded_sampling_is_reproducible(pair):
    first = pair.generate(PROMPTS, method="specdiff", max_new_tokens=12, temperature=1.0, seed=3)
    again = pair.generate(PROMPTS, method="specdiff", max_new_tokens=12, temperature=1.0, seed=3)
    other = pair.generate(PROMPTS, method="specdiff", max_new_tokens=12, temperature=1.0, seed=4)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert [r.token_ids for r in first] != [r.token_ids for r in other]


def test_seeded_sampling_of_a_cost_aware_method_is_reproducible_with_recorded_costs(pair):
    """Cost-aware sizes follow measured seconds, so two seeded sampled runs may consume their random draws
    differently; with the costs recorded (`verify_costs_s`, `draft_cost_s`) every size is a function of the tokens
    alone (the union tree's drafter gate included), and the run is reproduced token for token (issue 33)."""
    costs = dict(verify_costs_s=[0.05 + 0.004 * n for n in range(33)], draft_cost_s=0.01)
    runs = [pair.generate(PROMPTS, method=method, max_new_tokens=16, temperature=1.0, seed=5, **costs)
            for method in ("specdiff_tree_cost", "specdiff_ngram_tree_cost") for _ in range(2)]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
    assert [r.token_ids for r in runs[2]] == [r.token_ids for r in runs[3]]
    # the recorded curve is the one sized with: where every token costs as much as the first, one node a step
    steep = pair.generate(PROMPTS, method="specdiff_tree_cost", max_new_tokens=16,
                          verify_costs_s=[float(n) for n in range(1, 34)], draft_cost_s=0.01)
    assert all(set(r.stats.tree_nodes) == {1} for r in steep)
    with pytest.raises(RecipeError, match="verify_costs_s holds 3 costs"):
        pair.generate(PROMPTS, method="specdiff_cost", verify_costs_s=[0.1, 0.2, 0.3])


@pytest.mark.slow
def test_the_cps_methods_build_nothing_in_the_callers_working_directory(tmp_path):
    """The tiny corpus and the fitted proxy a CPS method needs by default go to align's cache folder ($ALIGN_CACHE),
    not to data/tiny under whatever folder the caller's script runs from (issue 36)."""
    code = (f"import align\npair = align.load(verifier={VERIFIER!r}, drafter={DRAFTER!r})\n"
            "print(pair.generate(['def add(a, b):'], method='specdiff_cps', max_new_tokens=4)[0].token_ids)")
    (tmp_path / "work").mkdir()
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path / "work", capture_output=True, text=True,
                          env=checkout_env(ALIGN_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1"), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert list((tmp_path / "work").iterdir()) == []
    assert any((tmp_path / "cache" / "data").rglob("*"))


def test_a_method_spelled_by_its_options_is_that_method(pair):
    named = pair.generate(PROMPTS, method="specdiff_cps_tree", max_new_tokens=12, temperature=1.0, seed=3)
    spelled = pair.generate(PROMPTS, method="specdiff+tree+cps", max_new_tokens=12, temperature=1.0, seed=3)
    assert [r.token_ids for r in spelled] == [r.token_ids for r in named]
    assert [r.stats.tree_nodes for r in spelled] == [r.stats.tree_nodes for r in named] and named[0].stats.tree_nodes
    with pytest.raises(RecipeError, match=r"^method 'specdiff\+adl\+tree': unknown; the methods are ar, "):
        pair.generate(PROMPTS, method="specdiff+adl+tree")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sd_ar", "specdiff_cps_adl"])
def test_generate_creates_its_tensors_on_the_models_device(pair, method):
    """As tests/test_devices.py checks the methods: with the default device set to `meta`, a tensor or generator made
    without the model's device would be a meta one and fail next to the CPU model."""
    settings = dict(method=method, max_new_tokens=8, temperature=0.8, top_k=20)
    expected = pair.generate(PROMPTS, **settings)
    with torch.device("meta"):
        results = pair.generate(PROMPTS, **settings)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]


@pytest.fixture(scope="module")
def end_token(pair) -> tuple[int, int]:
    """A token of the first prompt's greedy continuation, first seen at position k >= 3: (token, k)."""
    tokens = pair.generate(PROMPTS[0], method="ar", max_new_tokens=NEW_TOKENS, eos_token_id=[])[0].token_ids
    k = next(k for k in range(3, len(tokens)) if tokens[k] not in tokens[:k])
    return tokens[k], k


@pytest.mark.slow
def test_generation_stops_at_the_verifiers_end_tokens_by_default(pair, end_token, tmp_path):
    """Instruct models list their end-of-turn token in generation_config.eos_token_id (a list), beside the tokenizer's
    eos_token: both end a generation unless the caller says otherwise."""
    token, k = end_token
    verifier = linked_copy(Path(VERIFIER), tmp_path / "verifier")
    config = json.loads((verifier / "generation_config.json").read_text())
    config["eos_token_id"] = [pair.tokenizer.eos_token_id, token]
    (verifier / "generation_config.json").write_text(json.dumps(config))
    stopping = align.load(verifier=str(verifier), drafter=DRAFTER)
    assert stopping.eos_token_ids == {pair.tokenizer.eos_token_id, token}
    full = pair.generate(PROMPTS[0], method="ar", max_new_tokens=NEW_TOKENS, eos_token_id=[])[0].token_ids
    for method in ("ar", "specdiff", "specdiff_adl", "hf_generate"):
        result = stopping.generate(PROMPTS[0], method=method, max_new_tokens=NEW_TOKENS)[0]
        assert result.token_ids == full[:k + 1] and result.finish_reason == "stop", method
        assert result.stats.new_tokens == k + 1
        assert result.token_ids == verifier_greedy(stopping, result.prompt_token_ids, sorted(stopping.eos_token_ids))
        # The caller overrides the end tokens: none at all, or others.
        assert stopping.generate(PROMPTS[0], method=method, max_new_tokens=NEW_TOKENS,
                                 eos_token_id=[])[0].token_ids == full
    assert pair.generate(PROMPTS[0], method="specdiff", max_new_tokens=NEW_TOKENS,
                         eos_token_id=token)[0].token_ids == full[:k + 1]
    assert align.load(verifier=str(verifier), eos_token_id=[]).generate(
        PROMPTS[0], method="ar", max_new_tokens=NEW_TOKENS)[0].token_ids == full


def test_chat_messages_are_rendered_with_the_verifiers_template(tmp_path):
    verifier = with_template(Path(VERIFIER), tmp_path / "verifier")
    chat = align.load(verifier=str(verifier), drafter=DRAFTER)
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    results = chat.generate([messages, "def add(a, b):"], method="specdiff", max_new_tokens=12)
    rendered = chat.tokenizer.decode(results[0].prompt_token_ids)
    assert rendered == "<|system|>You write Python.\n<|user|>def add(a, b):\n<|assistant|>"
    assert results[0].prompt_token_ids == render_prompt(chat.tokenizer, messages, TEMPLATE)
    assert chat.tokenizer.decode(results[1].prompt_token_ids) == "<|user|>def add(a, b):\n<|assistant|>"
    for result in results:
        ar = chat.generate([result.prompt_token_ids], method="ar", max_new_tokens=12)[0]
        assert result.token_ids == ar.token_ids
    # chat_template="off": text as it is, and messages refused
    plain = align.load(verifier=str(verifier), chat_template="off")
    assert plain.generate("def add(a, b):", method="ar", max_new_tokens=1)[0].prompt_token_ids == \
        plain.tokenizer("def add(a, b):", add_special_tokens=False).input_ids
    with pytest.raises(RecipeError, match=r"^prompt 0: chat messages need a chat template \(chat_template='off'\)"):
        plain.generate([messages], method="ar")


@pytest.fixture(scope="module")
def dflash_drafter(tmp_path_factory) -> str:
    """A DFlash drafter with random weights, shaped to the tiny verifier and saved as training saves one."""
    from align.checkpoint import save_merged
    from align.config import DFlashSection, VerifierSection
    from align.models import load_tokenizer
    from align.drafters.loading import new_dflash_drafter

    folder = tmp_path_factory.mktemp("dflash") / "drafter"
    tokenizer = load_tokenizer(VERIFIER)
    torch.manual_seed(0)
    drafter, _ = new_dflash_drafter(VerifierSection(path=VERIFIER), DFlashSection(aux_layer_ids=[0]),
                                    VerifierSection(path=VERIFIER, device="cpu"), tokenizer.mask_token_id, 4)
    save_merged(drafter, tokenizer, folder, {})
    return str(folder)


@pytest.mark.slow
def test_a_dflash_drafter_runs_its_methods_and_refuses_the_others(dflash_drafter, pair):
    dflash = align.load(verifier=VERIFIER, drafter=dflash_drafter)
    assert dflash.spec.kind == "dflash"
    reference = pair.generate(PROMPTS, method="ar", max_new_tokens=12)
    results = dflash.generate(PROMPTS, method="specdiff", max_new_tokens=12)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    with pytest.raises(RecipeError, match=r"^method 'specdiff2_select' does not run a DFlash drafter .*; its methods "
                                          f"are {', '.join(DFLASH_METHODS)}$"):
        dflash.generate(PROMPTS, method="specdiff2_select")


@pytest.fixture(scope="module")
def verifier_only():
    return align.load(verifier=VERIFIER)


@pytest.mark.parametrize("call, message", [
    (lambda p: p.generate(PROMPTS, method="medusa"),
     rf"^method 'medusa': unknown; the methods are {', '.join(METHODS)}$"),
    (lambda p: p.generate([], method="ar"), r"^prompts: the list is empty; give at least one prompt$"),
    (lambda p: p.generate("", method="ar"), r"^prompt 0: empty; the verifier needs at least one token to continue$"),
    (lambda p: p.generate([["x"]], method="ar"), r"^prompt 0: a prompt is text, chat messages .* or token ids"),
    (lambda p: p.generate(["ok", "bad \ud800"], method="ar"),
     r"^prompt 1: not valid Unicode text \(surrogates not allowed at character 4\)$"),
    (lambda p: p.generate([[1, 10**6]], method="ar"), r"^prompt 0: token ids must lie in \[0, 8192\)"),
    (lambda p: p.generate(torch.tensor([[1, 2]]), method="ar"), r"^prompts: give token ids as a list of ints"),
    (lambda p: p.generate([[{"role": "user", "content": 3}]], method="ar"),
     r"^prompt 0: message 0 is not a \{role, content\} of strings"),
    (lambda p: p.generate([[{"role": "user", "content": "hi"}]], method="ar"),
     r"^prompt 0: chat messages need a chat template \(the tokenizer of .*verifier has none\); pass text or token "
     r"ids$"),
    (lambda p: p.generate(["x " * 2000], method="ar"),
     r"^prompt 0 has \d+ tokens; with max_new_tokens=64 it exceeds the verifier's context of 1024$"),
    (lambda p: p.generate(PROMPTS, method="ar", eos_token_id="</s>"), r"^eos_token_id: a token id or a list of them"),
    (lambda p: p.generate(PROMPTS, method="ar", eos_token_id=[2, 10**9]),
     r"^eos_token_id: 1000000000 is outside the verifier's vocabulary \(8192 tokens\)$"),
    (lambda p: p.generate(PROMPTS, method="ngram", gamma=True), r"^decode\.gamma: expects a number, not a boolean"),
    (lambda p: p.generate(PROMPTS, method="ar", temperature=True),
     r"^decode\.temperature: expects a number, not a boolean"),
    (lambda p: p.generate(PROMPTS, method="suffix_ngram", tree_nodes=10**6),
     r"^decode\.tree_nodes: Input should be less than or equal to 1024"),
    (lambda p: p.generate(PROMPTS, method="sd_ar"),
     r"^method 'sd_ar' needs an AR drafter: pass align\.load\(\.\.\., ar_drafter=<folder or Hub id>\) \(methods the "
     r"loaded models run: ar, hf_generate, prompt_lookup, ngram, suffix, ngram_cost, suffix_ngram, suffix_cost, "
     r"suffix_ngram_cost\)$"),
    (lambda p: p.generate(PROMPTS, method="specdiff_cps"),
     r"^method 'specdiff_cps' needs a diffusion drafter: pass align\.load\(\.\.\., drafter=<folder or Hub id>\)"),
])
def test_bad_input_is_one_line_naming_what_to_fix(verifier_only, call, message):
    with pytest.raises(ValueError, match=message) as caught:
        call(verifier_only)
    assert isinstance(caught.value, RecipeError) and "\n" not in str(caught.value)


@pytest.mark.parametrize("kwargs, message", [
    (dict(drafter=VERIFIER), r"^drafter\.path: .*verifier is the verifier \(verifier\.path\); a drafter is a diffusion"),
    (dict(drafter=AR_DRAFTER), r"^drafter\.path: .*ar-drafter is not a diffusion drafter"),
    (dict(ar_drafter=DRAFTER), r"^ar_drafter\.path: .*drafter-base is a diffusion drafter"),
    (dict(drafter="no/such-model"), r"^drafter\.path: no/such-model is not a local folder, and the Hub is offline"),
    (dict(drafter=str(TINY / "nothing")), r"^drafter\.path: no such model folder: "),
    (dict(dtype="fp8"), r"^verifier\.dtype: Input should be 'device', 'auto', 'float32', 'bfloat16' or 'float16' "),
    (dict(tempreature=0.5), r"^unknown setting 'tempreature' \(did you mean 'temperature'\?\)$"),
    (dict(chat_template="on"), r"^data\.chat_template: on, but the tokenizer of .*verifier has no chat template"),
    (dict(drafter={"path": DRAFTER, "logit_shift": 1}), r"^drafter: unknown field 'logit_shift' \(fields: "),
    (dict(drafter=3), r"^drafter: a local folder, a Hub id or a mapping of its settings \(got int\)$"),
    (dict(verifier=None), r"^verifier: a local folder, a Hub id or a mapping of its settings \(got NoneType\)$"),
    (dict(data_dir=__file__), r"^data_dir: .*test_api\.py is a file; name a folder"),
    (dict(max_new_tokens=True), r"^decode\.max_new_tokens: expects a number, not a boolean"),
])
def test_bad_models_and_settings_are_refused_before_loading_weights(kwargs, message):
    with pytest.raises(ValueError, match=message) as caught:
        align.load(**{"verifier": VERIFIER, **kwargs})
    assert isinstance(caught.value, RecipeError) and "\n" not in str(caught.value)


def readme_example(readme: Path) -> str:
    """The first ```python block under the README's "## Python API" heading."""
    section = readme.read_text().split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found, "the README's Python API section has no ```python block"
    return found.group(1)


@pytest.mark.slow
def test_the_readmes_python_example_runs():
    code = readme_example(ROOT / "README.md")
    assert "align.load(" in code and ".generate(" in code
    env = checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip(), "the example printed nothing"
