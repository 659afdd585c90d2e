"""align/disk.py and align/checkpoint.py: what is published is whole, what was there survives a failure, merged
weights keep the run's dtype and the drafter's own class."""

import json
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


def _tied_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


def _remote(family: str, tmp_path: Path):
    from remote_code_families import write_family

    from align.models import load_tokenizer
    from align.drafters.loading import load_drafter
    from align.recipe_files import load_recipe

    folder = write_family(family, tmp_path / family)
    section = load_recipe("recipes/tiny/align.yaml", [f"drafter.path={folder}", "drafter.trust_remote_code=true",
                                                      "drafter.dtype=bfloat16"]).drafter
    return load_drafter(section, load_tokenizer(str(folder), True))[0]


def _diffusion_gemma(tmp_path: Path):
    from test_diffusion_gemma import tiny_diffusion_gemma

    return tiny_diffusion_gemma(0)


def _dflash(tmp_path: Path):
    from test_dflash import pruned_dflash, tiny_verifier

    return pruned_dflash(tiny_verifier())


def _saved(folder: Path) -> tuple[dict[str, object], dict[str, object]]:
    """What a folder holds: its weights by name (whatever shard holds them), and each other file by name (each
    safetensors file's metadata, each json, each code file); not align's own (the marker, the checksums)."""
    from safetensors import safe_open

    weights: dict[str, object] = {}
    files: dict[str, object] = {}
    for path in sorted(folder.iterdir()):
        if path.name in (".align", "sha256.json"):
            continue
        if path.suffix == ".safetensors":
            with safe_open(path, "pt") as f:
                files[path.name] = f.metadata()
                weights.update({k: f.get_tensor(k) for k in f.keys()})
        elif path.name == "model.safetensors.index.json":  # which shard holds a weight may differ (see below)
            index = json.loads(path.read_text())
            files[path.name] = (index["metadata"], sorted(index["weight_map"]))
            assert all(key in f.keys() for key, file in index["weight_map"].items()
                       for f in [safe_open(folder / file, "pt")])
        else:
            files[path.name] = json.loads(path.read_text()) if path.suffix == ".json" else path.read_bytes()
    return weights, files


@pytest.mark.parametrize("build", [lambda tmp: _tied_llama(), lambda tmp: _remote("dream", tmp),
                                   lambda tmp: _remote("llada", tmp), _diffusion_gemma, _dflash],
                         ids=["tied-llama", "dream", "llada", "diffusion-gemma", "dflash-pruned"])
def test_a_streamed_save_writes_save_pretrained_s_folder_holding_a_shard_at_most(build, tmp_path):
    """The ZeRO-3 save's writer, run on a whole model (the gathers are no-ops): what save_pretrained writes at the
    same shard size (the same files, index and weights, each in its dtype, tied ones once; configs and remote code),
    with at most about a shard of weights held at once, not the model. Shards follow the modules' order, where
    save_pretrained may sort the names (it does for Dream), so which shard holds a weight may differ."""
    from align.checkpoint import save_streamed, streamed_save_plan

    model = build(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[1] / "checkpoints" / "tiny" / "tokenizer")
    total = sum(t.nbytes for t in model.state_dict().values())
    shard = total // 5
    plan = streamed_save_plan(model, shard)
    assert plan is not None and plan.is_sharded
    held = save_streamed(model, plan, tokenizer, tmp_path / "streamed", {"meta.json": "{}"}, writer=True)
    model.save_pretrained(tmp_path / "reference", max_shard_size=shard)
    tokenizer.save_pretrained(tmp_path / "reference")
    (tmp_path / "reference" / "meta.json").write_text("{}")
    (weights, files), (reference_weights, reference_files) = _saved(tmp_path / "streamed"), _saved(tmp_path / "reference")
    assert files == reference_files
    assert sorted(weights) == sorted(reference_weights)
    for key, tensor in reference_weights.items():
        assert weights[key].dtype == tensor.dtype and torch.equal(weights[key], tensor), key
    largest = max(t.nbytes for t in model.state_dict().values())
    assert held <= shard + largest and held < total / 2
