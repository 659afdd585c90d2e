"""`align prompts` (Magpie, align/stages/prompts.py) on the tiny verifier: the filters, resuming, the refusals. The real
verifier's prompts are tested in test_smollm2.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from align.chat import end_of_turn_ids, user_turn
from align.cli import main
from align.config_inputs import PromptsSection
from align.models import load_tokenizer
from align.stages.prompts import Filter
from conftest import CHAT_TEMPLATE as TEMPLATE

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "checkpoints" / "tiny" / "verifier"
RECIPE = "recipes/smollm2/prompts.yaml"


def one_line_refusal(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("align prompts: error: ") and err.count("\n") == 1, err
    return err


# --------------------------------------------------------------------------------------------------------------------
# the template's user turn, and the filters
# --------------------------------------------------------------------------------------------------------------------
def test_the_user_turn_is_read_off_the_template(chat_verifier):
    tokenizer = load_tokenizer(str(chat_verifier))
    assert user_turn(tokenizer, TEMPLATE) == ("<|user|>", "<|endoftext|>")
    assert end_of_turn_ids(tokenizer, TEMPLATE) == [tokenizer.eos_token_id]
    # A template that ends turns with plain text has no end-of-turn token.
    assert end_of_turn_ids(tokenizer, TEMPLATE.replace("<|endoftext|>", "\n")) == []


def test_a_system_prompt_steers_its_chunks_only(chat_verifier, tmp_path, capsys, monkeypatch):
    import torch

    from align.recipe_files import load_recipe
    from align.models import load_verifier
    from align.stages.prompts import plan, sample_chunk

    args = [f"verifier.path={chat_verifier}", f"prompts.out={tmp_path / 'prompts'}", "prompts.batch_size=2",
            "prompts.max_new_tokens=6", "prompts.system_prompts=[null, You help with arithmetic.]"]
    recipe = load_recipe(RECIPE, args)
    made = plan(recipe)
    assert made.prefixes == ["<|user|>", "<|system|>You help with arithmetic.<|endoftext|><|user|>"]
    # Chunk c samples after system prompt c mod 2: chunk 3 draws exactly what the verifier samples after the steered
    # prefix with that chunk's seed, and chunk 2 what it samples after the plain one.
    verifier = load_verifier(recipe.verifier)
    for chunk, prefix in ((2, made.prefix_ids[0]), (3, made.prefix_ids[1])):
        torch.manual_seed(7)
        ids = torch.tensor([prefix]).expand(2, -1)
        expected = verifier.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                     top_p=1.0, top_k=0, max_new_tokens=6, eos_token_id=made.stop_ids,
                                     pad_token_id=made.stop_ids[0])[:, ids.shape[1]:].tolist()
        samples = sample_chunk(verifier, made, recipe.prompts, chunk, 7)
        assert [s["ids"] for s in samples] == [row[: len(s["ids"])] for row, s in zip(expected, samples)]
        assert all(s["ended"] or len(s["ids"]) == 6 for s in samples)
    # Another list of system prompts is other sampling settings: a folder of the first is not reused for it.
    assert plan(load_recipe(RECIPE, args[:-1])).settings_hash != made.settings_hash
    # A template that drops system messages cannot steer: refused in one line, before any sampling.
    dropping = chat_verifier.parent / "dropping"
    shutil.copytree(chat_verifier, dropping, symlinks=True)
    (dropping / "chat_template.jinja").write_text(TEMPLATE.replace("{% for m in messages %}",
                                                                   "{% for m in messages if m.role != 'system' %}"))
    capsys.readouterr()
    # RECIPE samples with vLLM: the template is refused first, with vLLM's environment or without it (issue 52)
    for vllm in (None, str(tmp_path / "no-vllm" / "python")):
        if vllm is not None:
            monkeypatch.setenv("ALIGN_VLLM_PYTHON", vllm)
        assert main(["prompts", RECIPE, *args, f"verifier.path={dropping}"]) == 2
        assert "does not render the system message 'You help with arithmetic.'" in one_line_refusal(capsys)
    assert not (tmp_path / "prompts").exists()  # refused before the output folder is made


def test_each_filter_drops_what_it_names():
    keep = Filter(PromptsSection(min_words=3, near_duplicate=0.5))
    offered = [
        ("How do I sort a list of tuples by their second item?", True, False, True),
        ("How do I sort a list of tuples by", False, False, False),  # no end-of-turn: cut short
        ("<|im_start|>assistant hello there friend", True, True, False),  # a turn marker inside
        ("Sort it.", True, False, False),  # 2 words
        ("Comment trier une liste en français, s'il vous plaît ? Merci beaucoup ; très bien", True, False, False),
        ("go go go go go go go go go go", True, False, False),  # a sampling loop
        ("how do I SORT a list of tuples   by their second item", True, False, False),  # the first, refolded
        ("How do I sort a list of tuples by their second field?", True, False, False),  # nearly the first
        ("Write a haiku about the sea at night.", True, False, True),
    ]
    for text, ended, special, kept in offered:
        assert keep.offer(text, ended, special) is kept, text
    assert keep.kept == [offered[0][0], offered[-1][0]]
    assert dict(keep.dropped) == {"cut_short": 1, "special_tokens": 1, "too_short": 1, "not_ascii": 1,
                                  "repetitive": 1, "duplicate": 1, "near_duplicate": 1}


# --------------------------------------------------------------------------------------------------------------------
# the stage
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_stage_resumes_and_counts_what_it_dropped(chat_verifier, tmp_path, capsys):
    # The tiny verifier writes Python source, whose "messages" mostly run past 16 tokens without an end of text: cut
    # short, as the manifest says; the stage keeps what passes within prompts.max_samples, and says when too few do.
    out = tmp_path / "prompts"
    args = ["prompts", RECIPE, f"verifier.path={chat_verifier}", f"prompts.out={out}", "prompts.num_prompts=4",
            "prompts.batch_size=4", "prompts.max_new_tokens=16", "prompts.max_samples=4"]
    assert main(args) == 0
    m = json.loads((out / "manifest.json").read_text())
    kept = m["counts"]["kept"]
    assert m["counts"] == {"asked": 4, "kept": kept, "samples_drawn": 4, "sampled_this_run": 4, "max_samples": 4}
    assert kept + sum(m["dropped"].values()) == 4 and m["dropped"]["cut_short"] >= 2, m["dropped"]
    assert len((out / "prompts.jsonl").read_text().splitlines()) == kept < 4
    assert f"warning: only {kept} of the 4" in capsys.readouterr().out
    # The recipe steers with three system prompts, the first none: chunk 0, the only one drawn, had the plain prefix.
    assert m["user_turn_prefixes"][0] == "<|user|>" and len(m["user_turn_prefixes"]) == 3
    assert m["kept_per_system_prompt"] == [kept, 0, 0]
    first = (out / "raw" / "chunk-00000.json").read_text()
    # More samples allowed: the first chunk is reused as it is, only the second is drawn.
    assert main([*args[:-1], "prompts.max_samples=8"]) == 0
    assert "of 8 samples (4 sampled this run" in capsys.readouterr().out
    assert (out / "raw" / "chunk-00000.json").read_text() == first
    assert json.loads((out / "raw" / "chunk-00001.json").read_text())["seed"] == 1
    # Other sampling settings in the same folder are refused, before the verifier loads; also when the manifest is
    # torn or gone (issue 35: the chunks of the earlier settings were then sampled over), by the chunks' own hash.
    assert main([*args, "prompts.temperature=0.7"]) == 2
    assert "holds samples drawn with other settings" in one_line_refusal(capsys)
    (out / "manifest.json").write_text('{"settings_hash": "')
    before = {path.name: path.read_text() for path in (out / "raw").iterdir()}
    assert main([*args, "prompts.temperature=0.7"]) == 2
    assert "chunk-00000.json holds samples drawn with other settings" in one_line_refusal(capsys)
    # An edited chunk that is still JSON is never read as the verifier's samples, nor a chunk missing a field.
    chunk = json.loads(first)
    chunk["samples"][0]["text"] = "an edited prompt"
    (out / "raw" / "chunk-00000.json").write_text(json.dumps(chunk))
    assert main(args) == 2
    assert "chunk-00000.json is not as it was written" in one_line_refusal(capsys)
    del chunk["samples"][0]["ended"]
    (out / "raw" / "chunk-00000.json").write_text(json.dumps(chunk))
    assert main(args) == 2
    assert "chunk-00000.json is not a chunk of samples" in one_line_refusal(capsys)
    assert {path.name: path.read_text() for path in (out / "raw").iterdir() if path.name != "chunk-00000.json"} == \
        {name: text for name, text in before.items() if name != "chunk-00000.json"}


def test_a_verifier_without_a_chat_template_is_refused(tmp_path, capsys):
    out = tmp_path / "prompts"
    assert main(["prompts", RECIPE, f"verifier.path={TINY}", f"prompts.out={out}"]) == 2
    assert "has no chat template" in one_line_refusal(capsys)
    assert main(["prompts", RECIPE, f"verifier.path={TINY}", f"prompts.out={out}", "data.chat_template=off"]) == 2
    assert "Magpie samples a user's message from the chat template" in one_line_refusal(capsys)
    assert not out.exists()


HAVE_VLLM = (ROOT / ".venv-vllm" / "bin" / "python").is_file() or bool(os.environ.get("ALIGN_VLLM_PYTHON"))


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_VLLM and not os.environ.get("CI"), reason="no .venv-vllm (CI always builds it)")
def test_vllm_samples_the_user_turns_each_from_a_seed_of_its_own(chat_verifier, tmp_path, capsys):
    # vLLM seeds a chunk's sample j with its seed + j: chunk seeds one apart gave chunk 1 three of chunk 0's four
    # samples (47% of 3,328 SmolLM2 samples were refused as duplicates before the seeds were spaced).
    out = tmp_path / "prompts"
    args = ["prompts", RECIPE, f"verifier.path={chat_verifier}", f"prompts.out={out}", "prompts.num_prompts=8",
            "prompts.batch_size=4", "prompts.max_new_tokens=16", "prompts.max_samples=8", "prompts.backend=vllm",
            "prompts.system_prompts=[null]", "prompts.min_ascii=0", "prompts.min_words=1"]
    assert main(args) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["engine"].startswith("vllm ") and m["settings"]["backend"] == "vllm"
    chunks = [json.loads((out / "raw" / f"chunk-{c:05d}.json").read_text())["samples"] for c in (0, 1)]
    samples = [tuple(s["ids"]) for chunk in chunks for s in chunk]
    assert len(samples) == 8 and len(set(samples)) == 8, samples
    assert all(len(s) <= 16 for s in samples)
    # A rerun samples nothing: the chunks are reused, and the engine is never started.
    assert main(args) == 0
    assert "nothing new sampled" in capsys.readouterr().out
