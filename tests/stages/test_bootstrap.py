"""`align bootstrap` end to end at toy sizes: every part is written, loads with plain transformers, and resumes."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from align.cli import main
from align.drafters.spec import DrafterSpec
from align.recipe_files import load_recipe
from align.stages.bootstrap import ar_step, build_model, pretrain, use_bf16

from conftest import TOY


@pytest.fixture(scope="module")
def family(toy_family):
    return toy_family


def test_every_part_has_a_manifest(family):
    root, _ = family
    for part in ("tokenizer", "verifier", "drafter-base", "ar-drafter"):
        manifest = json.loads((root / "ck" / part / "manifest.json").read_text())
        assert manifest["part"] == part and manifest["corpus_hash"] and manifest["command"].startswith("align bootstrap")
        if part != "tokenizer":
            assert manifest["parameters"] > 0 and manifest["tokens_seen"] > 0 and manifest["wall_time_s"] > 0
            assert np.isfinite(manifest["validation_loss"])
    verifier = json.loads((root / "ck" / "verifier" / "manifest.json").read_text())
    assert len(verifier["samples"]) == 3 and all("completion" in s for s in verifier["samples"])
    data = json.loads((root / "data" / "manifest.json").read_text())
    assert data["prompts"]["train"] > 0 and data["prompts"]["test"] > 0
    assert (root / "data" / "prompts" / "test.jsonl").is_file()


def test_parts_load_with_plain_transformers(family):
    root, _ = family
    tokenizer = AutoTokenizer.from_pretrained(root / "ck" / "tokenizer")
    assert tokenizer.eos_token and tokenizer.pad_token and tokenizer.mask_token
    assert len({tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.mask_token_id}) == 3
    text = "def f(x):\n        return x  # ünïcode\n"
    assert tokenizer.decode(tokenizer(text).input_ids) == text  # byte-level: indentation and any text round-trip
    for part in ("verifier", "drafter-base", "ar-drafter"):
        model = AutoModelForCausalLM.from_pretrained(root / "ck" / part)
        assert model.dtype == torch.bfloat16  # shipped in bf16 to stay small
        assert model.config.vocab_size == len(tokenizer)
    spec = AutoModelForCausalLM.from_pretrained(root / "ck" / "drafter-base").config.drafter_spec
    assert DrafterSpec(**spec) == DrafterSpec(tokenizer.mask_token_id, 0, "block_causal")


def test_rerun_keeps_finished_parts(family, capsys):
    root, args = family
    before = {p: (root / "ck" / p / "model.safetensors").stat().st_mtime_ns for p in ("verifier", "drafter-base")}
    assert main(args) == 0
    assert "up to date" in capsys.readouterr().out
    assert before == {p: (root / "ck" / p / "model.safetensors").stat().st_mtime_ns for p in before}


@pytest.mark.slow
def test_pretraining_resumes_from_its_saved_state(tmp_path, family):
    root, _ = family
    tokenizer = AutoTokenizer.from_pretrained(root / "ck" / "tokenizer")
    cfg = load_recipe(None, [t for t in TOY if t.startswith("bootstrap.verifier")] + [
        # Never due by the clock: the state that a resumed run starts from is the one saved at the last step.
        "bootstrap.verifier.save_every_minutes=1000"]).bootstrap.verifier
    stream = np.random.default_rng(0).integers(0, len(tokenizer), 5000).astype(np.int32)
    streams = {"train": stream, "validation": stream[:1000]}
    torch.manual_seed(0)
    first = build_model(cfg, tokenizer)
    stats = pretrain("verifier", cfg, first, streams, ar_step, tmp_path, "hash", 0, False)
    assert (tmp_path / "state.pt").is_file() and stats["steps"] > 0
    # A fresh process would rebuild a freshly initialised model; it must come back as the saved one.
    torch.manual_seed(1)
    second = build_model(cfg, tokenizer)
    resumed = pretrain("verifier", cfg, second, streams, ar_step, tmp_path, "hash", 0, False)
    assert resumed["steps"] == stats["steps"] and resumed["tokens_seen"] == stats["tokens_seen"]
    for a, b in zip(first.state_dict().values(), second.state_dict().values()):
        assert torch.equal(a, b)
    # A state saved for other settings is not resumed.
    torch.manual_seed(1)
    third = build_model(cfg, tokenizer)
    other = pretrain("verifier", cfg, third, streams, ar_step, tmp_path / "x", "other-hash", 0, False)
    assert other["steps"] > 0


def test_auto_precision_follows_the_cpu_that_trains_not_a_gpu(monkeypatch):
    # On the H200 gpu_check machine bootstrap said "precision bf16" because a GPU was there, and then trained on the
    # CPU: a CPU without native bf16 would have emulated it, many times slower than fp32.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for flags, native in (("flags\t: fpu avx2", False), ("flags\t: fpu avx2 avx512_bf16", True)):
        monkeypatch.setattr("align.stages.bootstrap.Path.read_text", lambda self, flags=flags: flags)
        assert use_bf16("auto") == native, flags
    assert use_bf16("bf16") and not use_bf16("fp32")
