"""A DFlash drafter written by the `speculators` package itself (in vLLM's environment, .venv-vllm, where it is
installed) reads in align as speculators wrote it: its block logits for one anchor, computed by speculators' own
forward on the same verifier states, equal align's from the folder (issue 36: third-party drafters in), for its full,
bidirectional layers and for the sliding, block-causal ones its trainer makes by default."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("ALIGN_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path(VLLM_PYTHON).is_file(),
                                 reason="no .venv-vllm (bash launch/setup_vllm.sh builds it; CI always does)")]

# Run in .venv-vllm: speculators' own construction (its training CLI's layer config, `from_training_args`, the
# verifier's embeddings and head loaded by it), saved with its own save_pretrained, and its own training forward
# (`_backbone_forward`) over one anchor: the block's logits, anchor slot first.
SPECULATORS_SIDE = r'''
import json, sys
import torch
from safetensors.torch import load_file, save_file
from speculators.models.dflash import DFlashDraftModel
from speculators.train.cli import create_transformer_layer_config

verifier, inputs, out, layer_ids = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
sliding_window, full_attention_indices = json.loads(sys.argv[6])
data = load_file(inputs)
torch.manual_seed(0)
layer_config = create_transformer_layer_config(verifier, num_layers=1, draft_arch="qwen3", hidden_act=None,
                                               sliding_window=sliding_window,
                                               full_attention_indices=full_attention_indices)
model = DFlashDraftModel.from_training_args(layer_config, verifier_name_or_path=verifier, target_layer_ids=layer_ids,
                                            block_size=5, draft_attn_impl="eager", draft_vocab_size=layer_config.vocab_size,
                                            mask_token_id=int(data["mask_token_id"]))
with torch.no_grad():  # norms start at 1: moved, so that reading one as another would show
    for name, p in model.named_parameters():
        if "norm" in name and p.requires_grad:
            p.add_(0.1 * torch.randn_like(p))
model.eval()
model.save_pretrained(out)
ids, hidden, anchor = data["ids"], data["hidden"], int(data["anchor"])
loss_mask = torch.zeros_like(ids)
loss_mask[0, anchor] = 1
with torch.no_grad():
    _, logits, *_ = model._backbone_forward(hidden, ids, loss_mask, torch.zeros(1, ids.shape[1], hidden.shape[-1] //
                                            len(layer_ids)), torch.zeros_like(ids), max_anchors=1)
save_file({"logits": logits[0].float().contiguous()}, sys.argv[5])
'''


# (sliding_window, full_attention_indices) as `speculators train` takes them: the one layer full (bidirectional, as
# align trains), or sliding as its trainer's default makes it (block-causal: sliding_window_non_causal stays false;
# the window covers the context, where speculators' count of it and vLLM's agree).
@pytest.mark.parametrize("layers", [(0, [0]), (64, [])], ids=["full", "sliding_causal"])
def test_a_speculators_written_dflash_drafter_gives_speculators_block_logits_in_align(tmp_path, layers):
    from align.config import DrafterSection, VerifierSection
    from align.drafters.base import aux_hidden
    from align.drafters.dflash import DFlashContext, dflash_block_logits
    from align.drafters.loading import load_drafter
    from align.models import load_tokenizer, load_verifier

    verifier_path = ROOT / "checkpoints" / "tiny" / "verifier"
    tokenizer = load_tokenizer(str(verifier_path))
    verifier = load_verifier(VerifierSection(path=str(verifier_path), device="cpu", dtype="float32"))
    layer_ids = [1, 3, 5]
    ids = torch.tensor([tokenizer("def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return").input_ids])
    anchor = ids.shape[1] - 6  # speculators anchors no later than block_size before the end
    with torch.no_grad():
        hidden = aux_hidden(verifier(input_ids=ids, output_hidden_states=True).hidden_states, layer_ids)
    save_file({"ids": ids, "hidden": hidden.contiguous(), "anchor": torch.tensor(anchor),
               "mask_token_id": torch.tensor(tokenizer.mask_token_id)}, str(tmp_path / "inputs.safetensors"))
    (tmp_path / "side.py").write_text(SPECULATORS_SIDE)
    folder = tmp_path / "speculator"
    ran = subprocess.run([VLLM_PYTHON, str(tmp_path / "side.py"), str(verifier_path), str(tmp_path / "inputs.safetensors"),
                          str(folder), json.dumps(layer_ids), str(tmp_path / "logits.safetensors"),
                          json.dumps(layers)],
                         capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    expected = load_file(str(tmp_path / "logits.safetensors"))["logits"]  # (block, V): the anchor slot first
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == layer_ids

    section = DrafterSection(path=str(folder), device="cpu", dtype="float32")
    assert config["sliding_window_non_causal"] is False  # speculators' default, whatever the layers
    if layers[1]:
        # vLLM reads the flag for every layer (dflash_config.causal), so it serves this full layer block-causal while
        # speculators trained it bidirectionally: align reads it as vLLM serves it, and says so ...
        with pytest.warns(UserWarning, match="set it true"):
            drafter, spec = load_drafter(section, tokenizer)
        assert (drafter.config.layer_types, drafter.config.causal) == (["full_attention"], True)
        # ... and with the flag set true, as the warning says, the layer is what speculators trained
        (folder / "config.json").write_text(json.dumps({**config, "sliding_window_non_causal": True}))
        drafter, spec = load_drafter(section, tokenizer)
        assert drafter.config.causal is False
    else:
        drafter, spec = load_drafter(section, tokenizer)
        assert (drafter.config.layer_types, drafter.config.sliding_window, drafter.config.causal) == \
            (["sliding_attention"], 64, True)
    assert spec.kind == "dflash" and spec.mask_token_id == tokenizer.mask_token_id
    context = DFlashContext()
    with torch.no_grad():
        context.extend(drafter, hidden[:, :anchor])
        logits = dflash_block_logits(drafter, verifier, ids[:, anchor:anchor + 1], 4, context)
    torch.testing.assert_close(logits.reshape(4, -1).float(), expected[1:], rtol=1e-4, atol=1e-4)
