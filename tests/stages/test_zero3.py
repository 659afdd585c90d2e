"""ZeRO-3 across ranks: every rank makes the same number of collective forwards, whatever its rows.

Under ZeRO-3 every forward of a module gathers its parameters from all ranks (a collective), and so does its backward.
DiffusionGemma's windows cost one encoder and one decoder forward each, and a row has min(windows, completion length)
of them: two ranks holding rows of very different lengths would make different numbers of collectives and wait on
each other forever. These tests run 2 DeepSpeed ranks (gloo, CPU) on trajectories written to make that happen.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import checkout_env
from test_diffusion_gemma import RECIPE, save_with_tokenizer, tiny_diffusion_gemma, tiny_gemma4_verifier

from align.config import RecipeError
from align.data import (HELD_OUT_EVERY, TRAJECTORY_MANIFEST, chat_template, rank_share, rows_at, stream_position,
                        verifier_end_tokens)
from align.launch import free_port
from align.models import load_tokenizer
from align.recipe_files import load_recipe
from align.stages.trajectories import settings_of, write_chunk

ROOT = Path(__file__).resolve().parents[2]
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")
TOKENIZER = str(ROOT / "checkpoints/tiny/tokenizer")
# Completion lengths, one per prompt: long ones (every window used) and ones shorter than the windows asked for.
LENGTHS = [40, 2, 3, 40, 2, 40, 3, 2] * 3
WINDOWS = 4
# Long enough for the ranks to load and run several steps here; a rank waiting on a collective its peer never makes
# waits for the process group's timeout (30 minutes).
HANG_S = 600


def write_trajectories(recipe, out: Path) -> None:
    """Trajectories as `align trajectories` writes them (chunk, checksums, manifest with the recipe's settings), of
    random token ids with the completion lengths of LENGTHS."""
    rng = np.random.default_rng(0)
    rows = [{"prompt_ids": rng.integers(3, 8000, 5).tolist(), "completion_ids": rng.integers(3, 8000, n).tolist(),
             "prompt_index": i} for i, n in enumerate(LENGTHS)]
    tokenizer = load_tokenizer(recipe.verifier.path)
    settings = settings_of(recipe, [r["prompt_ids"] for r in rows],
                           chat_template(tokenizer, recipe.data.chat_template, recipe.verifier.path),
                           verifier_end_tokens(recipe, tokenizer))
    settings_hash = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    write_chunk(rows, out / "chunks" / "chunk-00000", settings_hash)
    chunk = json.loads((out / "chunks" / "chunk-00000" / "chunk.json").read_text())
    (out / TRAJECTORY_MANIFEST).write_text(json.dumps({
        "settings_hash": settings_hash, "settings": settings, "rows": len(rows),
        "completion_tokens": chunk["tokens"], "chunks": {"chunk-00000": chunk["sha256"]}}))


def canvas_setup(root: Path) -> list[str]:
    """A tiny Gemma 4 verifier and DiffusionGemma drafter written under `root`; the recipe overrides (with RECIPE) of
    3 ZeRO-3 steps on uneven trajectories at root/trajectories, which the caller writes (write_trajectories).
    Shared with launch/gpu_check_steps.py, which runs the same step on GPUs."""
    tokenizer = load_tokenizer(TOKENIZER)
    verifier = save_with_tokenizer(tiny_gemma4_verifier(1), tokenizer, root / "verifier")
    drafter = save_with_tokenizer(tiny_diffusion_gemma(0), tokenizer, root / "drafter")
    return [f"verifier.path={verifier}", f"drafter.path={drafter}", "verifier.dtype=float32", "drafter.dtype=float32",
            f"trajectories.out={root / 'trajectories'}", "trajectories.max_new_tokens=40",
            "trajectories.completions_per_prompt=1", "train.gamma=4", f"train.windows_per_sequence={WINDOWS}",
            "train.micro_batch_size=1", "train.gradient_accumulation_steps=2", "train.warmup_steps=0",
            "train.max_steps=3", "train.eval_every=1", "train.zero_stage=3"]


@pytest.fixture(scope="module")
def canvas_run(tmp_path_factory):
    """(recipe overrides, the loaded recipe) of a tiny DiffusionGemma drafter on uneven trajectories, ZeRO-3, saving
    at every step and keeping the last two."""
    root = tmp_path_factory.mktemp("zero3")
    args = [*canvas_setup(root), "train.save_every=1", "train.keep_last=2"]
    recipe = load_recipe(RECIPE, args)
    write_trajectories(recipe, root / "trajectories")
    return args, recipe


def used_windows(length: int) -> int:
    return min(WINDOWS, length)


@pytest.mark.slow  # a 2-rank DeepSpeed run (the fixture)
def test_the_ranks_rows_ask_for_different_numbers_of_forwards(canvas_run):
    """The premise of the run below: in its steps and in its held-out metric the two ranks' rows need different
    numbers of window forwards (else the run would pass on code that lets them differ)."""
    _, recipe = canvas_run
    t = recipe.train
    train_rows = [i for i, n in enumerate(LENGTHS) if i % HELD_OUT_EVERY]
    held_out = [i for i in range(len(LENGTHS)) if i % HELD_OUT_EVERY == 0]
    step_forwards = [[sum(used_windows(LENGTHS[train_rows[i]]) for m in range(t.gradient_accumulation_steps)
                          for i in rows_at(stream_position(step, m, rank, 2, recipe), t.micro_batch_size, t.seed,
                                           len(train_rows)))
                      for rank in range(2)] for step in range(t.max_steps)]
    assert any(a != b for a, b in step_forwards), step_forwards
    held = [sum(used_windows(LENGTHS[i]) for i in rank_share(held_out, rank, 2)[0]) for rank in range(2)]
    assert held[0] != held[1], held


def run_on_two_ranks(recipe_and_args: list[str], out: Path) -> list[dict]:
    """align train on 2 DeepSpeed ranks (ZeRO-3 in the arguments) writing to `out`; its metrics records. A hang fails
    the test."""
    cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "align/train.py",
           *recipe_and_args, f"train.out={out}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=checkout_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log = proc.communicate(timeout=HANG_S)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log = proc.communicate()[0]
        pytest.fail(f"the 2-rank ZeRO-3 run hung (killed after {HANG_S} s): {log[-2000:]}")
    assert proc.returncode == 0, log[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # two 2-rank ZeRO-3 DeepSpeed runs
def test_zero3_on_two_ranks_with_uneven_completions_finishes(canvas_run, tmp_path):
    args, _ = canvas_run
    out = tmp_path / "run"
    records = run_on_two_ranks([RECIPE, *args], out)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["expected_streak"]) for r in records), records
    # A save under ZeRO-3 at every step, and only the last two kept.
    assert sorted(p.name for p in out.glob("step_*")) == ["step_2", "step_3"]
    assert sorted(p.name for p in (out / "ds_state").glob("step_*")) == ["step_2", "step_3"]
    # The checkpoint rank 0 wrote holds the trained weights: DeepSpeed's fp32 master weights (from the shards in
    # ds_state) in the run's dtype (bf16), bit for bit.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    saved = load_file(out / "step_3" / "model.safetensors")
    master = get_fp32_state_dict_from_zero_checkpoint(str(out / "ds_state"), tag="step_3")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    shared = [k for k in saved if k in master]
    assert len(shared) >= len(saved) - 1, set(saved) - set(master)  # (a tied output embedding is saved once)
    assert all(torch.equal(saved[k], master[k].to(torch.bfloat16)) for k in shared)


@pytest.mark.slow  # a 2-rank ZeRO-3 DeepSpeed run
def test_a_drafter_that_drops_masks_under_zero3_with_uneven_windows_finishes(tmp_path):
    """LLaDA's attention drops masks, so align reads its padded bidirectional windows a row (a window) at a time: the
    ranks' rows ask for different numbers of forwards, in the steps and in the held-out metric, as the canvas run's do
    (`test_the_ranks_rows_ask_for_different_numbers_of_forwards`, the same trajectories). With a count of one forward
    per batch the two ranks waited forever, one in an all-reduce, the other in an all-gather (issue 34). The real
    LLaDA files when $ALIGN_REMOTE_CODE names them, else the stand-in."""
    from remote_code_families import write_family, write_qwen2

    args = [f"verifier.path={write_qwen2(tmp_path / 'verifier', seed=3)}",
            f"drafter.path={write_family('llada', tmp_path / 'llada', seed=7)}", "drafter.trust_remote_code=true",
            "verifier.dtype=float32", "drafter.dtype=float32", f"trajectories.out={tmp_path / 'trajectories'}",
            "trajectories.max_new_tokens=40", "trajectories.completions_per_prompt=1", "train.gamma=4",
            f"train.windows_per_sequence={WINDOWS}", "train.micro_batch_size=1", "train.gradient_accumulation_steps=2",
            "train.warmup_steps=0", "train.max_steps=3", "train.eval_every=1", "train.zero_stage=3"]
    tiny = ROOT / "recipes/tiny/align.yaml"
    write_trajectories(load_recipe(tiny, args), tmp_path / "trajectories")
    *steps, final = run_on_two_ranks([str(tiny), *args], tmp_path / "run")
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["expected_streak"]) for r in steps), steps
    assert final["final_tau"] >= 1.0  # and the trained drafter decodes in align's runtime


@pytest.mark.slow  # a 2-rank ZeRO-3 DeepSpeed run
def test_a_lora_run_under_zero3_saves_its_trained_adapter(toy_trajectories, tmp_path):
    """Under ZeRO-3 each rank holds a shard of the adapter too: the adapter rank 0 writes is DeepSpeed's consolidated
    one, equal to the fp32 master weights in the run's dtype, and the frozen base is not rewritten. (The tiny family:
    DiffusionGemma's shared encoder-decoder weights refuse LoRA.)"""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file
    from test_multi_node import recipe_args

    out = tmp_path / "run"
    run_on_two_ranks([*recipe_args(toy_trajectories, out), "train.lora_r=4", "train.max_steps=2",
                      "train.save_every=2"], out)
    assert not (out / "step_2" / "model.safetensors").exists()
    adapter = load_file(out / "step_2" / "adapter_model.safetensors")
    master = get_fp32_state_dict_from_zero_checkpoint(str(out / "ds_state"), tag="step_2")
    # peft saves `…lora_A.weight` for the module's `…lora_A.default.weight`
    trained = {k.replace(".default.", "."): v for k, v in master.items() if ".lora_" in k}
    assert adapter and set(adapter) == set(trained), set(adapter) ^ set(trained)
    assert all(torch.equal(adapter[k], trained[k].to(adapter[k].dtype)) for k in adapter)
    assert any(trained[k].abs().sum() > 0 for k in trained if "lora_B" in k)  # trained (lora_B starts at zero)


# --------------------------------------------------------------------------------------------------------------------
# the keys that make ZeRO-3 runs scale: fp32 gradient accumulation, pruned checkpoints, a capped held-out metric
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, expected", [
    (["train.zero_stage=3"], {"grad_accum_dtype": "fp32"}),  # the default under bf16 with ZeRO
    (["train.zero_stage=2", "train.grad_accum_dtype=bf16"], {"grad_accum_dtype": "bf16"}),
    (["train.zero_stage=0"], None),  # DeepSpeed has no fp32 accumulation for bf16 weights without ZeRO
    (["train.zero_stage=3", "train.bf16=false"], None),  # fp32 weights: fp32 gradients
])
def test_gradients_accumulate_in_fp32_under_bf16_with_zero(overrides, expected):
    from align.dist import deepspeed_config

    config = deepspeed_config(load_recipe("recipes/tiny/align.yaml", ["train.bf16=true", *overrides]))
    assert config.get("data_types") == expected


@pytest.mark.parametrize("overrides, says", [
    (["train.grad_accum_dtype=fp32", "train.bf16=false"], "bf16 training only"),
    (["train.grad_accum_dtype=fp32", "train.bf16=true", "train.zero_stage=0"], "needs zero_stage >= 1"),
    (["train.grad_accum_dtype=fp16"], "train.grad_accum_dtype"),
    (["train.keep_last=0"], "train.keep_last"),
    (["train.held_out_max_rows=0"], "train.held_out_max_rows"),
])
def test_bad_values_of_the_new_keys_are_refused_in_one_line(overrides, says, capsys):
    from align.cli import main

    assert main(["validate", "recipes/tiny/align.yaml", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and says in err, err


def test_your_deepspeed_config_is_merged_and_conflicts_are_refused_by_key(tmp_path, capsys):
    # train.deepspeed_config (issue 36): a user's DeepSpeed JSON joins what align derives; a key align derives may be
    # repeated, not changed, and what align builds itself (optimizer, scheduler) is refused, each in one line naming
    # the key, before any launcher starts (`align validate` reads the recipe only; the stage's check reads the file).
    from align.cli import main
    from align.dist import deepspeed_config
    from align.stages.train import check_train

    def recipe_with(config) -> list[str]:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(config) if not isinstance(config, str) else config)
        return ["train.zero_stage=2", "train.bf16=true", f"train.deepspeed_config={path}"]

    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "overlap_comm": False},
               "train_micro_batch_size_per_gpu": 4, "zero_allow_untested_optimizer": True}
    config = deepspeed_config(load_recipe("recipes/tiny/align.yaml",
                                          [*recipe_with(offload), "train.micro_batch_size=4"]))
    assert config["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}, "overlap_comm": False}
    assert config["zero_allow_untested_optimizer"] is True and config["bf16"] == {"enabled": True}
    assert config["zero_force_ds_cpu_optimizer"] is False  # align's torch AdamW steps the offloaded state
    for given, says in [
        ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage is 3 in your file, but align sets it from "
                                              "train.zero_stage (2); set train.zero_stage instead"),
        ({"gradient_clipping": 0.5}, "gradient_clipping is 0.5 in your file, but align sets it from train.grad_clip"),
        ({"bf16": True}, "bf16 is True in your file, but align sets it from train.bf16"),
        ({"optimizer": {"type": "AdamW"}}, "optimizer is not taken from your file: align builds AdamW"),
        ({"scheduler": {"type": "WarmupLR"}}, "scheduler is not taken from your file"),
        ({"fp16": {"enabled": True}}, "fp16 is not taken from your file"),
        ("[1, 2]", "is not a JSON object"), ("{'stage': 2}", "is not JSON"),
    ]:
        with pytest.raises(RecipeError, match="^train.deepspeed_config: ") as refused:
            check_train(load_recipe("recipes/tiny/align.yaml", recipe_with(given)))
        assert says in str(refused.value) and "\n" not in str(refused.value), refused.value
    quiet = deepspeed_config(load_recipe("recipes/tiny/align.yaml", recipe_with({"fp16": {"enabled": False},
                                                                               "steps_per_print": 5})))
    assert quiet["steps_per_print"] == 5 and quiet["fp16"] == {"enabled": False}  # DeepSpeed's printing is yours
    out = tmp_path / "run"
    assert main(["train", "recipes/tiny/align.yaml", "train.deepspeed_config=/nonexistent/ds.json",
                 f"train.out={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("align train: error: train.deepspeed_config: /nonexistent/ds.json cannot be read") \
        and "\n" not in err, err
    assert not out.exists()


def test_the_collective_timeout_covers_rank_0s_save_of_the_drafter(tmp_path, monkeypatch):
    """DeepSpeed's default (10 minutes) ends a run whose rank 0 is still writing and hashing a large checkpoint while
    the others wait in their next collective: align sizes the wait from the drafter's weights (a 26B bf16 drafter:
    52 GB on disk, about 416 GB written and hashed with its DeepSpeed state), and $DEEPSPEED_TIMEOUT overrides it."""
    from datetime import timedelta

    from align.dist import collective_timeout

    monkeypatch.delenv("DEEPSPEED_TIMEOUT", raising=False)
    folder = tmp_path / "drafter"
    folder.mkdir()
    with open(folder / "model-00001-of-00001.safetensors", "wb") as f:
        f.truncate(52_000_000_000)  # a sparse file: its size, not its bytes
    big = load_recipe("recipes/tiny/align.yaml", [f"drafter.path={folder}"])
    assert collective_timeout(big) == timedelta(minutes=30 + 35)  # 416 GB at 200 MB/s: 34.7 minutes
    assert collective_timeout(load_recipe("recipes/tiny/align.yaml")) == timedelta(minutes=31)  # tiny: its floor
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "7")
    assert collective_timeout(big) == timedelta(minutes=7)


def test_keep_last_prunes_older_checkpoints_never_the_latest(tmp_path):
    from align.checkpoint import prune_checkpoints

    for step in range(1, 6):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "model.safetensors").write_text("x")
        (tmp_path / "ds_state" / f"step_{step}").mkdir(parents=True)
    (tmp_path / "ds_state" / "latest").write_text("step_1")  # (a hand edit: resume from step 1)
    prune_checkpoints(tmp_path, 2)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["ds_state", "step_1", "step_4", "step_5"]
    assert sorted(p.name for p in (tmp_path / "ds_state").iterdir()) == ["latest", "step_1", "step_4", "step_5"]


def test_the_held_out_metric_reads_a_fixed_sample_of_capped_size():
    from align.stages.train import held_out_sample

    held_out = list(range(0, 4000 * 20, 20))
    sample = held_out_sample(held_out, 256, seed=0)
    assert len(sample) == 256 and set(sample) <= set(held_out) and sample == sorted(sample)
    assert held_out_sample(held_out, 256, seed=0) == sample  # the same rows at every eval
    assert held_out_sample(held_out[:100], 256, seed=0) == held_out[:100]
    assert held_out_sample(held_out, None, seed=0) == held_out


# --------------------------------------------------------------------------------------------------------------------
# loading under ZeRO-3: each rank builds and fills only its partition
# --------------------------------------------------------------------------------------------------------------------
# Run by the DeepSpeed launcher on 2 ranks: load the drafter as align train does under ZeRO-3, report what each rank
# holds, then (the engine built) check the masks as align train does and compare every gathered weight with the file.
PARTITIONED_LOAD = """
import json, sys
from pathlib import Path
import deepspeed, torch
from align.checkpoint import save_streamed, streamed_save_plan
from safetensors.torch import load_file
from align.drafters.loading import check_masks_are_read, load_drafter
from align.models import is_partitioned, load_tokenizer, partitioned_loading
from align.recipe_files import load_recipe
from align.remote_code import masks_ignored
from align.checkpoint import gathering_for_a_save
from align.dist import collective_timeout, deepspeed_config, init_distributed

folder, remote, report = sys.argv[-3:]  # (the launcher puts --local_rank=N first)
recipe = load_recipe("recipes/tiny/align.yaml", [f"drafter.path={folder}", f"drafter.trust_remote_code={remote}",
                                                  "drafter.dtype=float32", "train.bf16=false", "train.zero_stage=3"])
rank, world = init_distributed(collective_timeout(recipe))
with partitioned_loading(deepspeed_config(recipe)):
    model, spec = load_drafter(recipe.drafter, load_tokenizer(folder, recipe.drafter.trust_remote_code))
held = {"partitioned": is_partitioned(model), "whole_elements": sum(p.data.numel() for p in model.parameters()),
        "shard_elements": sum(p.ds_tensor.numel() for p in model.parameters()),
        "model_elements": sum(p.ds_numel for p in model.parameters())}
model.requires_grad_(True)  # as align train does (load_drafter hands it frozen)
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.0),
                                  config=deepspeed_config(recipe))
if recipe.drafter.trust_remote_code:
    check_masks_are_read(model, spec)
saved, equal = load_file(f"{folder}/model.safetensors"), {}
for name, p in model.named_parameters():
    if name in saved:
        with deepspeed.zero.GatheredParameters([p]):
            equal[name] = torch.equal(p.data, saved[name].to(p.dtype))
model.eval()
with torch.no_grad():  # the engine's hooks gather each layer for the forward; computed buffers (rotary) as built
    logits = model(input_ids=torch.arange(3, 11)[None]).logits[0].tolist()
held.update(masks_ignored=masks_ignored(model), equal=equal, parameters=len(list(model.parameters())), logits=logits)
# align train's save of a partitioned drafter, in shards of a quarter of the weights: each rank gathers, rank 0 writes.
weight_bytes = sum(p.ds_numel * p.element_size() for p in model.parameters())
plan = streamed_save_plan(model, weight_bytes // 4)
with gathering_for_a_save(engine):
    held["held_bytes"] = save_streamed(model, plan, load_tokenizer(folder, recipe.drafter.trust_remote_code),
                                       Path(f"{report}.saved"), {}, writer=rank == 0)
held.update(weight_bytes=weight_bytes, shards=len(plan.filename_to_tensors),
            largest_bytes=max(p.ds_numel * p.element_size() for p in model.parameters()))
with open(f"{report}.{rank}", "w") as f:
    json.dump(held, f)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow  # 2-rank DeepSpeed launches
@pytest.mark.parametrize("family", ["tiny", "dream", "llada"])
def test_zero3_loads_each_ranks_partition_only_and_the_gathered_weights_are_the_files(family, tmp_path):
    """No rank builds the whole drafter (`whole_elements` 0: every parameter is an empty placeholder between forwards),
    each holds about half; gathered, every weight equals the file's. Remote code's mask check runs once the engine
    gathers the weights, and finds what it finds on a whole model (LLaDA ignores masks, Dream reads them); a forward
    through the engine gives the whole model's logits."""
    from remote_code_families import write_family

    from align.drafters.loading import load_drafter as load_whole
    from align.remote_code import masks_ignored

    remote = family != "tiny"
    folder = write_family(family, tmp_path / family) if remote else ROOT / "checkpoints/tiny/drafter-base"
    script = tmp_path / "load.py"
    script.write_text(PARTITIONED_LOAD)
    port = str(free_port())
    proc = subprocess.run([DEEPSPEED, "--num_gpus", "2", "--master_port", port, str(script), str(folder), str(remote),
                           str(tmp_path / "report")], cwd=ROOT, env=checkout_env(OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"report.{rank}").read_text()) for rank in (0, 1)]
    whole = load_recipe("recipes/tiny/align.yaml", [f"drafter.path={folder}", f"drafter.trust_remote_code={remote}",
                                                    "drafter.dtype=float32"]).drafter
    model, _ = load_whole(whole, load_tokenizer(str(folder), remote))
    elements = sum(p.numel() for p in model.parameters())
    for report in reports:
        assert report["partitioned"] and report["whole_elements"] == 0, report
        assert report["model_elements"] == elements
        # DeepSpeed pads each parameter's partition to a multiple of the world size: about half, never the whole.
        assert report["shard_elements"] <= elements // 2 + report["parameters"], report
        assert report["equal"] and all(report["equal"].values()), report["equal"]
        assert len(report["equal"]) >= report["parameters"] - 1  # (a tied output embedding is saved once)
        assert report["masks_ignored"] == masks_ignored(model) == (family == "llada")
        with torch.no_grad():
            assert torch.equal(torch.tensor(report["logits"]), model(input_ids=torch.arange(3, 11)[None]).logits[0])
    # The streamed save: rank 0 held about a shard, never the drafter, and the folder loads as the whole model.
    assert reports[0]["shards"] >= 3 and reports[1]["held_bytes"] == 0
    assert reports[0]["held_bytes"] <= reports[0]["weight_bytes"] // 4 + reports[0]["largest_bytes"]
    saved, _ = load_whole(whole.model_copy(update={"path": str(tmp_path / "report.saved")}),
                          load_tokenizer(str(tmp_path / "report.saved"), remote))
    for (name, tensor), (saved_name, saved_tensor) in zip(model.state_dict().items(), saved.state_dict().items()):
        assert name == saved_name and torch.equal(tensor, saved_tensor), name
