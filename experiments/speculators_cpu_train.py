"""`speculators train` (speculators 0.9.0) on a CPU, its installed files left untouched: run with vLLM's python,
the same arguments as `speculators train`.

Without an accelerator the single-process trainer stops at two places (docs/results/2026-12-01-speculators-trainer.md):
- speculators/train/trainer.py:221 keeps `get_local_rank()` (the int 0) as the device, and :348 `model.to(0)` (then
  :533 `batch.to(0)`) raise "RuntimeError: Cannot access accelerator device when none is available.";
- trainer.py:80 and :92 (the step timer) call `torch.accelerator.synchronize()` unconditionally: the same error.
- trainer.py:228 sets the autocast device type to "cuda" without an accelerator, so `--hidden-states-dtype bfloat16`
  autocasts nothing on the CPU and the first bf16 hidden state meets an fp32 weight ("expected m1 and m2 to have the
  same dtype"); float32 runs, at about three times the cost of a step here.
This wrapper gives the trainer the device "cpu" (and the autocast device type "cpu") and makes the timer's synchronise
a no-op when there is no accelerator; a patch upstream would do the same (a `torch.device` from
`torch.accelerator.current_accelerator()` or "cpu"). Two
more CPU limits need no patch, only flags: `--draft-attn-impl sdpa` (FlexAttention has no backward on a CPU) and
`--loss-implementation eager` (the fused losses are Triton kernels).
"""

import sys

import torch

import speculators.train.trainer as trainer

_synchronize = torch.accelerator.synchronize


def _synchronize_if_any(*args, **kwargs):
    if torch.accelerator.is_available():
        _synchronize(*args, **kwargs)


torch.accelerator.synchronize = _synchronize_if_any
trainer.get_local_rank = lambda: "cpu"  # read once, in Trainer.__init__: model and batches go to the CPU
_init = trainer.Trainer.__init__


def _init_on_cpu(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    if not torch.accelerator.is_available():
        self.device_type = "cpu"  # torch.autocast's device type: bf16 autocast on the CPU, as align trains


trainer.Trainer.__init__ = _init_on_cpu

from speculators.train.cli import main  # noqa: E402
from speculators.train.config import TrainConfig  # noqa: E402

if __name__ == "__main__":
    main(TrainConfig.resolve(sys.argv[1:]))
