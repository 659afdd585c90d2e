"""`align serve-check` (issue #13, item 3): a tiny DFlash drafter on the shipped tiny verifier, exported in the
speculators format and served by vLLM, decodes exactly what vLLM without it and align's AR greedy decode, with vLLM's
mean acceptance length within 10% of align's τ; and what it refuses before any work.

Needs vLLM's environment (.venv-vllm, or ALIGN_VLLM_PYTHON); skipped without it except in CI, as
tests/stages/test_vllm.py. One serve-check run starts two vLLM engines (without and with the drafter), three with
serve_check.ngram: about a minute each on a CPU.
"""

import json
from pathlib import Path

import pytest
import torch

from align.cli import main as align
from align.machine import cpu_model
from test_vllm import ROOT, VERIFIER, needs_vllm

PROMPTS = [
    'def add(a, b):\n    """Return the sum of a and b."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import os\n\n\ndef walk_files(root):\n",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number (fibonacci(0) == 0)."""\n    if n < 2:\n',
]
GAMMA = 4
MAX_NEW_TOKENS = 32
TRAIN_STEPS = 20
DRAFT_VOCAB = 512  # of the tiny verifier's 8192 tokens


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def dflash_checkpoint(folder: Path, train_steps: int) -> Path:
    """A DFlash drafter (blocks of GAMMA + 1) on the shipped tiny verifier, trained `train_steps` passes over the
    verifier's greedy continuations of the test's own prompts, so that its acceptance is far from trivial (a random
    one accepts almost nothing, and any two engines agree on that); saved as align train saves one. Its draft
    vocabulary is pruned to the DRAFT_VOCAB tokens of those continuations and prompts (and the lowest ids), so that
    vLLM serves the d2t map: a wrong map would draft other tokens than align's, and the acceptances would part."""
    from align.checkpoint import save_merged
    from align.config import DFlashSection, VerifierSection
    from align.decoding.ar import ar_generate
    from align.drafters.dflash import DraftVocab, dflash_window_logits, most_frequent_tokens, set_draft_vocab
    from align.models import load_tokenizer, load_verifier
    from align.drafters.loading import new_dflash_drafter

    tokenizer = load_tokenizer(str(VERIFIER))
    section = VerifierSection(path=str(VERIFIER), device="cpu", dtype="float32")
    verifier = load_verifier(section)
    torch.manual_seed(0)
    drafter, _ = new_dflash_drafter(section, DFlashSection(aux_layer_ids=[1, 3, 6], intermediate_size=256,
                                                           draft_vocab_size=DRAFT_VOCAB),
                                    section, tokenizer.mask_token_id, GAMMA)
    sequences = []
    for text in PROMPTS:
        prompt_ids = tokenizer(text, return_tensors="pt").input_ids
        completion, _ = ar_generate(verifier, prompt_ids, MAX_NEW_TOKENS)
        sequences.append((torch.cat([prompt_ids, torch.tensor([completion])], dim=1), prompt_ids.shape[1]))
    keep = most_frequent_tokens([ids[0, n:].tolist() for ids, n in sequences],
                                [ids[0, :n].tolist() for ids, n in sequences], DRAFT_VOCAB, drafter.config.vocab_size)
    set_draft_vocab(drafter, verifier.get_output_embeddings().weight, keep)
    vocab = DraftVocab.of(drafter)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    drafter.train()
    for _ in range(train_steps):
        for clean_ids, prompt_len in sequences:
            # every window whose drafted tokens are all completion tokens
            starts = torch.arange(prompt_len, clean_ids.shape[1] - GAMMA + 1)[None]
            draft_logits, _ = dflash_window_logits(drafter, verifier, clean_ids, starts, GAMMA)
            targets = clean_ids[0, starts[0, :, None] + torch.arange(GAMMA)]  # (W, γ): slot j drafts start + j
            targets = vocab.draft_ids[targets]  # all of them kept
            loss = torch.nn.functional.cross_entropy(draft_logits[0].flatten(0, 1), targets.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    drafter.eval()
    save_merged(drafter, tokenizer, folder, {})
    return folder


def serve_check(prompt_file, drafter, out, *extra):
    return align(["serve-check", "recipes/tiny/dflash.yaml", f"verifier.path={VERIFIER}", "verifier.dtype=float32",
                  f"serve_check.drafter={drafter}", f"serve_check.out={out}", f"eval.prompts={prompt_file}",
                  f"decode.gamma={GAMMA}", f"decode.max_new_tokens={MAX_NEW_TOKENS}", *extra])


@pytest.mark.slow  # vLLM's start-up: ~2 min on this CPU
@needs_vllm
def test_served_drafter_decodes_identically_with_acceptance_within_10_percent(prompt_file, tmp_path):
    checkpoint = dflash_checkpoint(tmp_path / "step_1", TRAIN_STEPS)
    export = tmp_path / "export"
    assert align(["export", "recipes/tiny/dflash.yaml", f"verifier.path={VERIFIER}", "verifier.dtype=float32",
                  f"drafter.path={checkpoint}", "export.format=speculators",
                  f"export.out={export}"]) in (0, None)
    assert serve_check(prompt_file, export, tmp_path / "check", "serve_check.concurrency=[1, 2]",
                       "serve_check.ngram=true") in (0, None)
    result = json.loads((tmp_path / "check" / "serve_check.json").read_text())
    # One engine per drafter setting (none, the DFlash drafter, vLLM's n-gram speculator), measured at each
    # concurrency: 1 (the check below) and 2 requests in flight.
    levels = result["concurrency"]
    assert [r["concurrency"] for r in levels] == [1, 2] and all(r["plain_tokens_per_second"] > 0 for r in levels)
    # The n-gram speculator is lossless too, and drafts (the prompts' code repeats itself: `self.`, `items`).
    ngram = result["vllm_ngram"]
    assert ngram["identical"] and ngram["num_drafts"] > 0 and ngram["mean_acceptance_length"] >= 1.0
    assert all(r["ngram_tokens_per_second"] > 0 for r in levels) and "+ n-gram" in (
        tmp_path / "check" / "report.md").read_text()
    assert levels[0]["mean_acceptance_length"] == result["vllm_drafter"]["mean_acceptance_length"]
    assert levels[1]["mean_acceptance_length"] > 1.0 and "| 2 |" in (tmp_path / "check" / "report.md").read_text()
    assert result["check"]["passed"], result["check"]["reason"]
    assert result["align"]["specdiff_identical"]
    assert result["vllm_plain"]["identical"] and result["vllm_drafter"]["identical"]
    drafted = result["vllm_drafter"]
    assert drafted["num_drafts"] > 0 and drafted["num_draft_tokens"] == GAMMA * drafted["num_drafts"]
    assert abs(result["check"]["acceptance_ratio"] - 1.0) <= 0.10
    assert result["align"]["tau"] > 1.25  # the trained drafter's acceptance is not trivial: the 10% means something
    assert cpu_model() in (tmp_path / "check" / "report.md").read_text()  # the CPU by name, not "x86_64"


@pytest.mark.slow
def test_refusals_are_one_line_before_any_work(prompt_file, tmp_path, capsys, monkeypatch):
    import align.stages.serve_check

    checkpoint = dflash_checkpoint(tmp_path / "step_0", 0)
    capsys.readouterr()  # the loading bars of making it

    started = []
    monkeypatch.setattr(align.stages.serve_check, "main", lambda *_: started.append(1))
    import align.vllm_engine

    monkeypatch.setenv("ALIGN_VLLM_PYTHON", str(Path(__import__("sys").executable)))  # any python: never started
    assert serve_check(prompt_file, checkpoint, tmp_path / "out") == 2  # ... but one without vllm is refused
    assert "has no vllm installed" in capsys.readouterr().err
    monkeypatch.setattr(align.vllm_engine, "_lacks_vllm", lambda python: None)  # taken as vLLM's, for the cases below
    cases = [
        (ROOT / "checkpoints" / "tiny" / "drafter-base", [], "standalone diffusion drafter, which vLLM cannot serve"),
        (tmp_path / "missing", [], "is not a drafter folder"),
        (checkpoint, [f"decode.gamma={GAMMA + 1}"], "decode.gamma"),
        (checkpoint, ["serve_check.concurrency=[1, 4]", "eval.num_prompts=2"], "serve_check.concurrency: 4"),
    ]
    for drafter, extra, said in cases:
        assert serve_check(prompt_file, drafter, tmp_path / "out", *extra) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err
    monkeypatch.setenv("ALIGN_VLLM_PYTHON", str(tmp_path / "no-python"))
    assert serve_check(prompt_file, checkpoint, tmp_path / "out") == 2
    assert "vllm needs vLLM's own environment" in capsys.readouterr().err
    assert not started and not (tmp_path / "out").exists()


def test_differing_outputs_fail_in_float32_and_are_noted_in_bf16():
    from align.stages.serve_check import identity_problems

    same = {"align specdiff": True, "vLLM": True, "vLLM with the drafter": True}
    assert identity_problems(same, "float32") == ([], None) and identity_problems(same, "bfloat16") == ([], None)
    differ = {**same, "vLLM with the drafter": False}
    assert identity_problems(differ, "float32") == (["vLLM with the drafter output differs from align AR greedy"],
                                                    None)
    failures, note = identity_problems(differ, "bfloat16")
    assert failures == [] and note.startswith("outputs of vLLM with the drafter differ") and "bfloat16" in note


@pytest.mark.parametrize("config, tokens", [
    ({"speculators_config": {"proposal_methods": [{"speculative_tokens": 3}]}}, 3),
    ({"speculators_config": {"proposal_methods": []}}, None),
    ({"speculators_config": {"proposal_methods": {"speculative_tokens": 3}}}, None),
    ({"speculators_config": {"proposal_methods": [{"speculative_tokens": True}]}}, None),
    ({"speculators_config": "greedy"}, None),
    ({}, None),
])
def test_the_folders_own_draft_tokens_are_read_where_vllm_reads_them(tmp_path, config, tokens):
    from align.stages.serve_check import exported_speculative_tokens

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert exported_speculative_tokens(tmp_path) == tokens
