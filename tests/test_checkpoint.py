"""align/disk.py and align/checkpoint.py: what is published is whole, what was there survives a failure, merged
weights keep the run's dtype and the drafter's own class."""

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from align.checkpoint import latest_step, merged_model, save_merged
from align.disk import atomic_file, atomic_folder, write_text_atomic


def test_a_failed_folder_write_leaves_the_old_folder(tmp_path):
    final = tmp_path / "step_2"
    with atomic_folder(final, "train") as tmp:
        (tmp / "a.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_folder(final, "train") as tmp:
            (tmp / "a.txt").write_text("half")
            raise RuntimeError("killed mid-write")
    assert (final / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2"]  # no temporary or .old folder left


def test_a_folder_is_replaced_whole(tmp_path):
    final = tmp_path / "out"
    with atomic_folder(final, "train") as tmp:
        (tmp / "stale.txt").write_text("x")
    with atomic_folder(final, "train") as tmp:
        (tmp / "new.txt").write_text("y")
    assert sorted(p.name for p in final.iterdir()) == [".align", "new.txt"]  # the marker: align wrote it


def test_a_symlinked_output_is_written_through_its_link(tmp_path):
    # A user's export.out (or eval.json) that is a link to another disk: the new folder or file replaces the link's
    # target, and the link stays a link (it was replaced by a real folder, leaving the target stale: issue 35).
    target, link = tmp_path / "disk" / "export", tmp_path / "export"
    with atomic_folder(target, "export") as tmp:
        (tmp / "old.txt").write_text("x")
    link.symlink_to(target)
    with atomic_folder(link, "export") as tmp:
        (tmp / "new.txt").write_text("y")
    assert link.is_symlink() and sorted(p.name for p in target.iterdir()) == [".align", "new.txt"]
    real, linked = tmp_path / "disk" / "eval.json", tmp_path / "eval.json"
    real.write_text("old")
    linked.symlink_to(real)
    write_text_atomic(linked, "new")
    assert linked.is_symlink() and real.read_text() == "new"


def test_a_failed_file_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "eval.json"
    write_text_atomic(path, "old")
    with pytest.raises(OSError):
        with atomic_file(path) as tmp:
            tmp.write_text("half")
            raise OSError("disk full")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["eval.json"]


def test_latest_step_is_numeric_and_ignores_unfinished(tmp_path):
    assert latest_step(tmp_path / "missing") is None
    for name in ("step_9", "step_10", ".step_11.tmp", "step_x", "ds_state"):
        (tmp_path / name).mkdir()
    assert latest_step(tmp_path) == tmp_path / "step_10"


class TinyDreamConfig(LlamaConfig):
    model_type = "tiny_dream"  # not in AutoModelForCausalLM's mapping, as Dream/DiffuCoder's remote code is not


class TinyDream(LlamaForCausalLM):
    config_class = TinyDreamConfig


def test_merged_model_keeps_the_drafters_class_and_the_runs_dtype(tmp_path):
    config = TinyDreamConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1)
    drafter = TinyDream(config).to(torch.bfloat16)
    with pytest.raises(ValueError):  # what an Auto lookup would do with such a family
        AutoModelForCausalLM.from_config(config)
    state = {k: v.clone() for k, v in drafter.state_dict().items()}
    merged = merged_model(drafter, state)
    assert type(merged) is TinyDream and merged.dtype == torch.bfloat16
    # Built on the meta device and given the state's tensors: no random initialisation, no second copy of the weights
    assert all(p.data_ptr() == state[name].data_ptr() for name, p in merged.named_parameters())
    assert all(torch.equal(a, b) for a, b in zip(merged.state_dict().values(), state.values()))
    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[1] / "checkpoints" / "tiny" / "tokenizer")
    save_merged(merged, tokenizer, tmp_path / "step_1", {"meta.json": "{}"})
    assert (tmp_path / "step_1" / "meta.json").read_text() == "{}"
    reloaded = TinyDream.from_pretrained(tmp_path / "step_1")
    assert reloaded.dtype == torch.bfloat16  # a bf16 run writes bf16 weights (half the size of fp32)
