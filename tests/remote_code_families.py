"""Tiny random dLLMs that ship their own modelling code, as the Hub's Dream/DiffuCoder and LLaDA do.

`write_family(name, folder)` writes a local model folder the way the Hub repos are laid out: config.json with
`auto_map` and the family's `model_type`, the configuration/modelling modules beside it (from tests/fixtures/<name>/,
small stand-ins with the real classes' interfaces), safetensors weights and the tiny tokenizer (whose mask token
becomes the config's `mask_token_id`). It loads only with `trust_remote_code=True`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "checkpoints" / "tiny" / "tokenizer"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def code_folder(name: str) -> Path:
    """Where family `name`'s modelling files come from: $ALIGN_REMOTE_CODE/<name> (the files as the Hub ships them,
    kept outside the repository) when that is set, else the stand-ins in tests/fixtures/<name>."""
    real = os.environ.get("ALIGN_REMOTE_CODE")
    return Path(real) / name if real else FIXTURES / name

# What the Hub configs say (Dream-org/Dream-v0-Instruct-7B and apple/DiffuCoder-7B-cpGRPO; GSAI-ML/LLaDA-8B-Instruct),
# with sizes made tiny. The vocabulary is the tiny tokenizer's, so that a tiny verifier can share it.
FAMILIES: dict[str, dict] = {
    "dream": dict(
        modules=("configuration_dream.py", "modeling_dream.py"),
        config=dict(architectures=["DreamModel"], model_type="Dream",
                    auto_map={"AutoConfig": "configuration_dream.DreamConfig",
                              "AutoModel": "modeling_dream.DreamModel"},
                    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, use_cache=False,
                    tie_word_embeddings=False, hidden_act="silu", rms_norm_eps=1e-06, rope_scaling=None,
                    use_sliding_window=False, attention_dropout=0.0, initializer_range=0.02),
    ),
    "llada": dict(
        modules=("configuration_llada.py", "modeling_llada.py"),
        config=dict(architectures=["LLaDAModelLM"], model_type="llada",
                    auto_map={"AutoConfig": "configuration_llada.LLaDAConfig",
                              "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
                              "AutoModel": "modeling_llada.LLaDAModelLM"},
                    d_model=32, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=64, max_sequence_length=512,
                    rope=True, rope_theta=10000.0, alibi=False, weight_tying=False, block_type="llama",
                    use_cache=False,
                    # the rest of the Hub config's fields, as they are there (the class defaults differ: swiglu)
                    activation_type="silu", alibi_bias_max=8.0, attention_dropout=0.0, attention_layer_norm=False,
                    attention_layer_norm_with_affine=True, bias_for_layer_norm=False, block_group_size=1,
                    embedding_dropout=0.0, flash_attention=False, include_bias=False, include_qkv_bias=False,
                    init_cutoff_factor=None, init_device="meta", init_fn="mitchell", init_std=0.02,
                    input_emb_norm=False, layer_norm_type="rms", layer_norm_with_affine=True, mlp_ratio=4,
                    multi_query_attention=None, precision="amp_bf16", residual_dropout=0.0, rms_norm_eps=1e-05,
                    rope_full_precision=True, scale_logits=False),
    ),
}


def restrict(model: Any, sharpen: float, favoured: Optional[range]) -> None:
    with torch.no_grad():
        weight = model.get_output_embeddings().weight
        weight.mul_(sharpen)
        if favoured is not None:
            keep = torch.zeros(weight.shape[0], dtype=torch.bool)
            keep[favoured.start:favoured.stop] = True
            weight[~keep] = 0.0


def write_family(name: str, folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32,
                 sharpen: float = 4.0, favoured: Optional[range] = None) -> Path:
    """Write a tiny random `name` ("dream" or "llada") model folder at `folder`; returns it.

    `sharpen` scales the output layer so that the random model has marked preferences; `favoured`: only these tokens
    get non-zero output weights, so that random drafter and verifier given the same set agree now and then.
    """
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from align.remote_code import install

    install()  # the real files need align's shims to build under transformers 5, as align's loader applies them
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    family = FAMILIES[name]
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    vocab = len(tokenizer)
    config = dict(family["config"], vocab_size=vocab, mask_token_id=tokenizer.mask_token_id,
                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    if name == "llada":
        config["embedding_size"] = vocab
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    # Both Hub repos ship one; Dream's own from_pretrained reads it (DreamGenerationConfig) and fails without it.
    generation = {k: config[k] for k in ("eos_token_id", "pad_token_id", "mask_token_id")}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    for module in sorted(code_folder(name).glob("*.py")):  # Dream's modelling code imports its generation_utils
        shutil.copy2(module, folder / module.name)
    torch.manual_seed(seed)
    model = AutoModel.from_config(AutoConfig.from_pretrained(folder, trust_remote_code=True), trust_remote_code=True)
    restrict(model, sharpen, favoured)
    # Weights written directly, as a transformers 4 save left them on the Hub: transformers 5's save_pretrained
    # refuses Dream's list-style `_tied_weights_keys` (align's own saves handle it: align/checkpoint.py).
    save_file({k: v.to(dtype).contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
    return folder


def write_qwen2(folder: Path, seed: int, sharpen: float = 4.0, layers: int = 2,
                favoured: Optional[range] = None) -> Path:
    """A tiny random Qwen2 causal LM (the Qwen2.5 verifiers' architecture) on the tiny tokenizer, as a model folder."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None))
    restrict(model, sharpen, favoured)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


def write_prompts(path: Path, count: int) -> Path:
    """A JSONL prompt file (`prompt` field) of short code prompts."""
    names = ["add", "scale", "merge", "split", "parse", "render", "count", "clamp", "flatten", "lookup", "fold", "zip"]
    lines = [json.dumps({"prompt": f"def {names[i % len(names)]}_{i}(a, b):\n    \"\"\"Return the {names[i % len(names)]} "
                                   f"of a and b.\"\"\"\n"}) for i in range(count)]
    Path(path).write_text("\n".join(lines) + "\n")
    return Path(path)
