"""A user's DeepSpeed JSON (train.deepspeed_config) is checked as DeepSpeed would read it, before any launcher starts
(issue 52): a key DeepSpeed does not know, a value of the wrong type, an offload the run's ZeRO stage cannot run are
refused in one line naming the dotted key; DeepSpeed itself would ignore them or fail in the ranks. Valid files, the
repo's own among them, still merge as before."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from align.config import RecipeError
from align.deepspeed_json import check_deepspeed_json
from align.recipe_files import load_recipe
from align.dist import deepspeed_config

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "tiny" / "align.yaml")


def config_of(tmp_path: Path, given: Any, *overrides: str) -> dict[str, Any]:
    """align.dist.deepspeed_config of the tiny recipe with `given` as its train.deepspeed_config."""
    path = tmp_path / "ds.json"
    path.write_text(given if isinstance(given, str) else json.dumps(given))
    return deepspeed_config(load_recipe(RECIPE, [*overrides, f"train.deepspeed_config={path}"]))


# the probe's four (tests/probe.py, finding 52), then their neighbours
REFUSED = [
    ({"steps_per_print": "often"}, 0, "steps_per_print: Input should be a valid integer (got 'often')"),
    ({"zero_optimisation": {"stage": 2}}, 0, "unknown DeepSpeed key 'zero_optimisation' (did you mean "
                                             "'zero_optimization'?)"),
    ({"zero_optimization": {"offload_param": {"device": "nvme"}}}, 0,
     "zero_optimization.offload_param: DeepSpeed offloads it only under ZeRO-3, and train.zero_stage is 0"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True}},
      "communication_data_type": "fp16"}, 0,
     "zero_optimization.offload_optimizer: DeepSpeed offloads it only under ZeRO stages 1-3, and train.zero_stage is "
     "0"),
    ({"steps_per_print": 0}, 0, "steps_per_print: Input should be greater than or equal to 1"),
    ({"wall_clock_breakdown": "true"}, 0, "wall_clock_breakdown: Input should be a valid boolean (got 'true')"),
    ({"communication_data_type": "fp8"}, 2, "communication_data_type: Input should be 'fp16', 'bf16' or 'fp32'"),
    ({"zero_optimization": {"overlap_com": False}}, 2,
     "unknown DeepSpeed key 'zero_optimization.overlap_com' (did you mean 'zero_optimization.overlap_comm'?)"),
    ({"zero_optimization": {"reduce_bucket_size": "big"}}, 2, "zero_optimization.reduce_bucket_size: Input should "
                                                               "be a valid integer"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, 2,
     "zero_optimization.offload_optimizer.device: Input should be 'none', 'cpu' or 'nvme' (got 'gpu')"),
    ({"zero_optimization": {"offload_optimizer": {"devise": "cpu"}}}, 2,
     "did you mean 'zero_optimization.offload_optimizer.device'?"),
    ({"zero_optimization": {"offload_param": {"device": "cpu"}}}, 2, "offload_param: DeepSpeed offloads it only "
                                                                      "under ZeRO-3, and train.zero_stage is 2"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}}, 2,
     "zero_optimization.offload_optimizer.device: nvme is ZeRO-Infinity, ZeRO-3 only"),
    ({"zero_optimization": {"offload_param": {"device": "nvme"}}}, 3,
     "zero_optimization.offload_param.nvme_path: required with device nvme"),
    ({"zero_optimization": {"cpu_offload": True}}, 0, "zero_optimization.offload_optimizer: DeepSpeed offloads it "
                                                      "only under ZeRO stages 1-3"),  # DeepSpeed's deprecated name
    ({"activation_checkpointing": {"partition_activation": True}}, 2,
     "did you mean 'activation_checkpointing.partition_activations'?"),
    ({"activation_checkpointing": {"cpu_checkpointing": "yes"}}, 2, "activation_checkpointing.cpu_checkpointing: "
                                                                     "Input should be a valid boolean"),
    ({"flops_profiler": {"enabled": True, "profile_step": "2"}}, 2, "flops_profiler.profile_step: Input should be a "
                                                                     "valid integer (got '2')"),
    ({"comms_logger": {"enabled": 1.5}}, 2, "comms_logger.enabled: Input should be a valid boolean"),
    ({"comms_logger": True}, 2, "comms_logger is True (expected an object)"),
    ({"bfloat16": {"enabled": True}}, 2, "bfloat16 is DeepSpeed's old name of 'bf16'"),
    ({"nebula": {"enabled": True}}, 2, "nebula: this DeepSpeed no longer has it"),
]


@pytest.mark.parametrize("given, stage, says", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_a_file_deepspeed_would_misread_is_refused_in_one_line_naming_the_key(tmp_path, given, stage, says):
    with pytest.raises(RecipeError, match="^train.deepspeed_config: ") as refused:
        config_of(tmp_path, given, f"train.zero_stage={stage}")
    message = str(refused.value)
    assert says in message and "\n" not in message and str(tmp_path / "ds.json") in message, message


VALID = [
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, 2),  # ZeRO-Offload
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                            "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 5e8}}, 2),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, 1),
    ({"zero_optimization": {"offload_param": {"device": "cpu", "pin_memory": True},
                            "stage3_max_live_parameters": 10**9, "stage3_prefetch_bucket_size": "auto",
                            "stage3_gather_16bit_weights_on_model_save": True}}, 3),
    ({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/local_nvme"},
                            "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}},
      "aio": {"block_size": 1048576, "queue_depth": 8}}, 3),  # ZeRO-Infinity
    ({"zero_optimization": {"offload_optimizer": {"device": "none"}}}, 0),  # no offload at all
    ({"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": False,
                                   "contiguous_memory_optimization": False, "number_checkpoints": None,
                                   "synchronize_checkpoint_boundary": False, "profile": False}}, 2),
    ({"comms_logger": {"enabled": True, "verbose": False, "prof_all": True, "debug": False}}, 0),
    ({"flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": -1, "top_modules": 1,
                         "detailed": True, "output_file": None}}, 0),
    ({"wall_clock_breakdown": True, "steps_per_print": 50, "memory_breakdown": False}, 0),
    ({"tensorboard": {"enabled": True, "output_path": "tb/", "job_name": "align"},
      "communication_data_type": "BF16", "fp16": {"enabled": False}}, 2),
]


@pytest.mark.parametrize("given, stage", VALID, ids=[str(i) for i in range(len(VALID))])
def test_common_valid_files_merge_as_before(tmp_path, given, stage):
    config = config_of(tmp_path, given, f"train.zero_stage={stage}")
    for key, value in given.items():
        if key == "zero_optimization":
            assert config[key] == {"stage": stage, **value}
        else:
            assert config[key] == value, key


def repo_files() -> list[tuple[str, dict[str, Any], int]]:
    """The DeepSpeed JSON the repo ships or documents: docs/gpus.md's example (run there with train.zero_stage=3),
    and the files the other tests write (tests/stages/test_zero3.py, tests/stages/test_train.py)."""
    docs = (ROOT / "docs" / "gpus.md").read_text()
    blocks = re.findall(r"```json\n(.*?)```", docs, re.S)
    shown = [json.loads(block) for block in blocks if "zero_optimization" in block]
    assert shown, "docs/gpus.md shows no DeepSpeed JSON"
    return [*(("docs/gpus.md", block, 3) for block in shown),
            ("tests/stages/test_zero3.py", {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                                                  "overlap_comm": False},
                                            "train_micro_batch_size_per_gpu": 8,  # the tiny recipe's, repeated
                                            "zero_allow_untested_optimizer": True}, 2),
            ("tests/stages/test_zero3.py", {"fp16": {"enabled": False}, "steps_per_print": 5}, 2),
            ("tests/stages/test_train.py", {"zero_optimization": {"offload_optimizer": {"device": "cpu"},
                                                                  "offload_param": {"device": "cpu"}}}, 3)]


@pytest.mark.parametrize("where, given, stage", repo_files(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_repos_own_deepspeed_files_pass(tmp_path, where, given, stage):
    config = config_of(tmp_path, given, f"train.zero_stage={stage}")
    assert config["zero_optimization"]["stage"] == stage, where


def test_a_refusal_is_exit_2_and_one_line_before_any_folder(tmp_path, capsys):
    from align.cli import main

    ds, out = tmp_path / "ds.json", tmp_path / "run"
    ds.write_text(json.dumps({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}))
    assert main(["train", RECIPE, f"train.deepspeed_config={ds}", f"train.out={out}", "train.zero_stage=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("align train: error: train.deepspeed_config: ") and "\n" not in err, err
    assert "zero_optimization.offload_optimizer" in err and not out.exists()


# --- check_deepspeed_json itself: `given` is the user's file, `merged` what DeepSpeed gets (align's stage in it) ----
def derived(stage: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage}, "bf16": {"enabled": False}, "steps_per_print": 10**9,
            "wall_clock_breakdown": False}


def test_the_stage_is_the_merged_one():
    given = {"zero_optimization": {"offload_param": {"device": "cpu"}}}
    merged = derived(3)
    merged["zero_optimization"].update(given["zero_optimization"])
    check_deepspeed_json(given, merged, "ds.json")  # ZeRO-3: runs
    merged["zero_optimization"]["stage"] = 1
    with pytest.raises(RecipeError, match=r"^train.deepspeed_config: ds.json: zero_optimization.offload_param: .*"
                                          r"train.zero_stage is 1.*set train.zero_stage=3"):
        check_deepspeed_json(given, merged, "ds.json")


def test_align_s_own_config_passes_and_an_empty_file_adds_nothing():
    for stage in range(4):
        check_deepspeed_json({}, derived(stage), "ds.json")


def test_names_are_checked_before_values():
    # a misspelled section is named, not what DeepSpeed would never read inside it
    given = {"zero_optimisation": {"offload_param": {"device": "gpu"}}}
    with pytest.raises(RecipeError, match="unknown DeepSpeed key 'zero_optimisation'"):
        check_deepspeed_json(given, {**derived(0), **given}, "ds.json")


def test_an_unknown_key_far_from_any_is_named_without_a_guess():
    with pytest.raises(RecipeError) as refused:
        check_deepspeed_json({"qqq": 1}, {**derived(0), "qqq": 1}, "ds.json")
    assert str(refused.value) == "train.deepspeed_config: ds.json: unknown DeepSpeed key 'qqq'"
