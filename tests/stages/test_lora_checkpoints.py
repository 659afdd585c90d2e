"""LoRA checkpoints hold adapters (#25 item 3): a LoRA run's step_<N>/ is peft's adapter with a checked pointer to its
base drafter; every reader merges it in memory, and `align export` writes the merged model."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import align
from align.checkpoint import BASE_RECORD
from align.cli import main
from align.config import RecipeError
from align.disk import record_checksums
from conftest import TOY_TRAJECTORIES
from test_train import launch, overrides

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 9, 11, 4], [7, 3, 8]]


@pytest.fixture(scope="module")
def lora_run(toy_family, tmp_path_factory):
    """(root, base drafter folder, run folder) of a 2-step LoRA run on the tiny family, on a copy of its drafter."""
    root, _ = toy_family
    tmp = tmp_path_factory.mktemp("lora")
    traj = tmp / "traj"  # (bootstrap.out named: the toy family's tokenizer is the tiny family's)
    assert main(["trajectories", "recipes/tiny/align.yaml", f"verifier.path={root / 'ck' / 'verifier'}",
                 f"bootstrap.out={root / 'ck'}", f"data.dir={root / 'data'}", f"trajectories.out={traj}",
                 "trajectories.num_prompts=8", "trajectories.batch_size=8", *TOY_TRAJECTORIES]) == 0
    toy_trajectories = (root, traj)
    base = tmp / "drafter-base"
    shutil.copytree(root / "ck" / "drafter-base", base)
    out = tmp / "run"
    args = overrides(toy_trajectories, out, f"bootstrap.out={root / 'ck'}", "train.max_steps=2", "train.lora_r=4",
                     "train.micro_batch_size=2",
                     "train.final_eval_prompts=1")
    args = [a for a in args if not a.startswith("drafter.path=")] + [f"drafter.path={base}"]
    rc, log = launch(1, args)
    assert rc == 0, log[-3000:]
    return root, base, out


def merged_by_hand(base: Path, step: Path) -> dict[str, torch.Tensor]:
    """The base's weights with each LoRA pair added (W + B·A·alpha/r), in the adapter's dtype (the run's), computed
    here from the files alone."""
    weights = load_file(str(base / "model.safetensors"))
    config = json.loads((step / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    adapter = load_file(str(step / "adapter_model.safetensors"))
    merged = dict(weights)
    for key, a in adapter.items():
        if ".lora_A." not in key:
            continue
        b = adapter[key.replace(".lora_A.", ".lora_B.")]
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        merged[name] = weights[name].to(a.dtype) + scale * (b @ a)  # in the run's dtype, as the merged save was
    return merged


def test_a_lora_step_folder_holds_the_adapter_only(lora_run):
    _, base, out = lora_run
    step = out / "step_2"
    names = {p.name for p in step.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "meta.json", BASE_RECORD, "sha256.json"} <= names
    assert not any(n.startswith("model") and n.endswith(".safetensors") for n in names)  # no base weights rewritten
    adapter_bytes = (step / "adapter_model.safetensors").stat().st_size
    assert adapter_bytes * 4 < (base / "model.safetensors").stat().st_size
    record = json.loads((step / BASE_RECORD).read_text())
    assert record["resolved"] == str(base.resolve()) and len(record["weights_sha256"]) == 64
    assert json.loads((step / "meta.json").read_text())["final_tau"] >= 1.0  # train's own final check read it


def test_the_api_decodes_a_lora_checkpoint_as_its_merged_form(lora_run, tmp_path):
    root, base, out = lora_run
    step = out / "step_2"
    merged = merged_by_hand(base, step)
    old_form = tmp_path / "merged"  # what a LoRA step_<N>/ held before: the merged model, loadable alone
    model = AutoModelForCausalLM.from_pretrained(base, dtype=next(iter(merged.values())).dtype)
    model.load_state_dict(merged, strict=False)  # (lm_head.weight is tied to the embeddings)
    model.save_pretrained(old_form)
    AutoTokenizer.from_pretrained(base).save_pretrained(old_form)
    verifier = str(root / "ck" / "verifier")
    from_adapter = align.load(verifier=verifier, drafter=str(step))
    from_merged = align.load(verifier=verifier, drafter=str(old_form))
    loaded = from_adapter.drafter.state_dict()
    assert all(torch.allclose(loaded[k].float(), v.float(), atol=1e-6) for k, v in merged.items())
    assert not any("lora" in k for k in loaded)  # merged: no LoRA layers left
    ours, theirs = (pair.generate(PROMPTS, method="specdiff", max_new_tokens=12)
                    for pair in (from_adapter, from_merged))
    assert len(ours) == len(PROMPTS)
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids and a.stats.accept_counts == b.stats.accept_counts


def test_export_writes_the_merged_weights(lora_run, tmp_path):
    root, base, out = lora_run
    step = out / "step_2"
    exported = tmp_path / "export"
    assert main(["export", str(ROOT / "recipes/tiny/align.yaml"), f"verifier.path={root / 'ck' / 'verifier'}",
                 f"drafter.path={step}", f"bootstrap.out={root / 'ck'}", f"data.dir={root / 'data'}",
                 f"export.out={exported}"]) == 0
    names = {p.name for p in exported.iterdir()}
    assert "adapter_config.json" not in names and BASE_RECORD not in names and "adapter_model.safetensors" not in names
    written = load_file(str(exported / "model.safetensors"))
    merged = merged_by_hand(base, step)
    assert set(written) <= set(merged) and written
    assert all(torch.allclose(written[k].float(), merged[k].float(), atol=1e-6) for k in written)
    alone = AutoModelForCausalLM.from_pretrained(exported)  # transformers alone, no base folder needed
    assert json.loads((exported / "config.json").read_text())["drafter_spec"]
    assert all(torch.allclose(p.float(), merged[n].float(), atol=1e-6) for n, p in alone.named_parameters())


def test_a_changed_base_drafter_is_refused_in_one_line(lora_run, tmp_path, capsys):
    root, base, out = lora_run
    changed = tmp_path / "changed-base"
    shutil.copytree(base, changed)
    weights = load_file(str(changed / "model.safetensors"))
    name = next(iter(weights))
    weights[name] = weights[name] + 1.0
    save_file(weights, str(changed / "model.safetensors"), metadata={"format": "pt"})
    step = tmp_path / "step_2"  # the checkpoint, its pointer aimed at the changed base (as if edited in place)
    shutil.copytree(out / "step_2", step)
    record = json.loads((step / BASE_RECORD).read_text())
    (step / BASE_RECORD).write_text(json.dumps({**record, "resolved": str(changed)}))
    record_checksums(step, [BASE_RECORD])
    with pytest.raises(RecipeError, match="weights have changed since it was trained"):
        align.load(verifier=str(root / "ck" / "verifier"), drafter=str(step))
    capsys.readouterr()
    rc = main(["export", str(ROOT / "recipes/tiny/align.yaml"), f"verifier.path={root / 'ck' / 'verifier'}",
               f"drafter.path={step}", f"bootstrap.out={root / 'ck'}", f"data.dir={root / 'data'}",
               f"export.out={tmp_path / 'export'}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "weights have changed" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "export").exists()


def test_a_lora_runs_deepspeed_state_leaves_out_the_frozen_base(lora_run):
    """The state a resume reads holds the adapter's weights and no frozen base weight (a 7B base is 15 GB a save);
    the resume below loads the base from drafter.path, which check_resumed_weights holds to the run's."""
    _, _, out = lora_run
    module = torch.load(out / "ds_state" / "step_2" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    adapter = load_file(str(out / "step_2" / "adapter_model.safetensors"))
    # (DeepSpeed's filter walks named_parameters, which names a tied weight once: the tiny drafter's output
    # embedding, the input embedding's alias, stays)
    assert {key for key in module if ".lora_" not in key} <= {"base_model.model.lm_head.weight"}
    assert len([key for key in module if ".lora_" in key]) == len(adapter)


def test_a_lora_run_resumes_from_its_adapter_checkpoint(lora_run):
    """Run last: it adds step_3 to the fixture's run (DeepSpeed state resumed, the new save an adapter again)."""
    _, base, out = lora_run
    args = overrides((lora_run[0], out.parent / "traj"), out, f"bootstrap.out={lora_run[0] / 'ck'}",
                     "train.max_steps=3",
                     "train.lora_r=4", "train.micro_batch_size=2", "train.final_eval_prompts=1")
    args = [a for a in args if not a.startswith(("drafter.path=", "verifier.path="))] + [
        f"drafter.path={base}", f"verifier.path={lora_run[0] / 'ck' / 'verifier'}"]
    rc, log = launch(1, args)
    assert rc == 0, log[-3000:]
    assert "resuming from step 2" in log
    assert (out / "step_3" / "adapter_model.safetensors").is_file()
    assert not (out / "step_3" / "model.safetensors").exists()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "loss" in line][-1] == 3
