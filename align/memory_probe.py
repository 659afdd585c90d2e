"""Memory by measurement: peak CPU tensor memory of a piece of work, and a recipe's peak per GPU (what `align memory`
reports, align/stages/memory.py, and what `align train` warns with).

Measured, not estimated: the CPU allocator reports every allocation and free to torch's profiler (profile_memory),
and the running sum of those reports is the bytes of tensor memory live at each moment; its maximum is the peak.

peak_per_gpu(recipe, world_size) builds ONE drafter layer at the recipe's real width (random weights, on the CPU, in
the recipe's dtype, with its LoRA adapters), the real vocabulary's LM head and the recipe's losses, runs forward and
backward on the recipe's largest micro-batch, measures them, and extrapolates the peak per GPU: parameters, gradients
and AdamW states sharded as the recipe's ZeRO stage shards them over memory.world_size ranks, activations × layers.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Optional

import torch

from align.config import Recipe, RecipeError
from align.drafters.kind import TrainedDrafter
from align.drafters.spec import KNOWN_DLLMS, VERIFIER_ARCHITECTURES
from align.preflight import context_length


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def allocation_trace(work: Callable[[], Any]) -> tuple[int, int, Any]:
    """(peak bytes above what was live when work() started, bytes still allocated when it returned, its result).

    Counts CPU tensors only (every tensor work() allocates, autograd's saved tensors and gradients included); the
    result is dropped only after the measurement, so what it holds counts while it is live.
    """
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():  # the profiler's C++ side writes a line to stderr at its start and at its stop
        prof.start()
    try:
        result = work()
    finally:
        with _quiet_stderr():
            prof.stop()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak, live, result


def cuda_allocation_trace(work: Callable[[], Any]) -> tuple[int, int, Any]:
    """allocation_trace on the current CUDA device: torch.cuda.max_memory_allocated above what was allocated when
    work() started, what was still allocated when it returned, its result."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = work()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start, torch.cuda.memory_allocated() - start, result


def peak_bytes(work: Callable[[], Any]) -> tuple[int, Any]:
    """(peak bytes of tensor memory allocated above what was live when work() started, work()'s result)."""
    peak, _, result = allocation_trace(work)
    return peak, result


# --------------------------------------------------------------------------------------------------------------------
# `align memory <recipe>`: one drafter layer at the recipe's width, measured, and the peak per GPU extrapolated
# --------------------------------------------------------------------------------------------------------------------
MIB, GIB = 2**20, 2**30
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Width:
    """A drafter's sizes: what one layer, the LM head and the parameter count are built from."""
    hidden_size: int
    intermediate_size: int  # the MLP width a token goes through (MoE: the active experts' together)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    parameters: int
    attention: str  # bidirectional | block_causal: how the training windows are laid out
    #: the model returns logits for every position (LLaDA: align/windows.py reads windows out of [B, T, V] logits)
    logits_over_sequence: bool = False
    source: str = ""


def _dense_parameters(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                      tied: bool) -> int:
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    return layers * (attention + 3 * hidden * inter + 2 * hidden) + vocab * hidden * (1 if tied else 2)


def _qwen_7b() -> dict[str, Any]:
    return dict(VERIFIER_ARCHITECTURES["qwen2.5-7b"][1])


# Hub drafters of the GPU recipes, by id (no Hub here): sizes from their config.json as published.
KNOWN_WIDTHS: dict[str, dict[str, Any]] = {
    # DiffuCoder-7B is Dream adapted from Qwen2.5-Coder-7B: Qwen2.5-7B's sizes (align/drafters/spec.py).
    "apple/DiffuCoder-7B-cpGRPO": dict(**_qwen_7b(), attention="bidirectional",
                                       source="Qwen2.5-7B's sizes (align/drafters/spec.py; DiffuCoder is Dream on "
                                              "Qwen2.5-Coder-7B)"),
    # LLaDA-8B-Instruct's config.json: d_model 4096, mlp_hidden_size 12288, 32 layers, 32 heads (no GQA),
    # vocabulary 126,464; the model returns logits over the whole sequence.
    "GSAI-ML/LLaDA-8B-Instruct": dict(vocab_size=126464, hidden_size=4096, intermediate_size=12288,
                                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                      attention="bidirectional", logits_over_sequence=True,
                                      source="LLaDA-8B-Instruct's config.json sizes"),
    # DiffusionGemma 26B-A4B: transformers' DiffusionGemmaTextConfig defaults (its docstring's checkpoint) for the
    # attention and dense MLP; its experts are not modelled layer by layer, the parameter count is the model's 26B.
    "google/diffusiongemma-26B-A4B-it": dict(vocab_size=262144, hidden_size=2304, intermediate_size=9216,
                                             num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=4,
                                             head_dim=256, parameters=26_000_000_000, attention="block_causal",
                                             source="transformers' DiffusionGemmaTextConfig defaults; 26B "
                                                    "parameters (MoE experts not measured layer by layer)"),
}


def _width_from_sizes(sizes: dict[str, Any], attention: Optional[str]) -> Width:
    hidden, heads = sizes["hidden_size"], sizes["num_attention_heads"]
    kv_heads = sizes.get("num_key_value_heads") or heads
    head_dim = sizes.get("head_dim") or hidden // heads
    inter = sizes["intermediate_size"]
    parameters = sizes.get("parameters") or _dense_parameters(
        hidden, inter, sizes["num_hidden_layers"], heads, kv_heads, head_dim, sizes["vocab_size"],
        bool(sizes.get("tie_word_embeddings", False)))
    return Width(hidden, inter, sizes["num_hidden_layers"], heads, kv_heads, head_dim, sizes["vocab_size"],
                 int(parameters), attention or sizes.get("attention", "bidirectional"),
                 bool(sizes.get("logits_over_sequence", False)), sizes.get("source", ""))


def drafter_width(recipe: Recipe) -> Width:
    """The drafter's sizes: its config.json where drafter.path is a folder, else the table of known Hub drafters.
    RecipeError when neither says."""
    if not TrainedDrafter.of(recipe).memory_modelled:
        raise RecipeError("dflash: align memory measures standalone drafters; a DFlash drafter is not modelled yet")
    path = recipe.drafter.path
    config_file = Path(path) / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        config = config.get("text_config", config)  # a multimodal config keeps the language model's sizes inside
        model_type = str(config.get("model_type", "")).lower()
        spec = config.get("drafter_spec") or {}
        attention = recipe.drafter.attention or spec.get("attention") or KNOWN_DLLMS.get(model_type, (0, None))[1]
        if attention is None:  # an AR model would be measured as a bidirectional drafter it is not
            raise RecipeError(f"drafter.path: {path} is not a diffusion drafter (its config.json has no drafter_spec "
                              f"and {model_type or 'its model_type'} is not a diffusion family); point drafter.path "
                              "at the drafter to train, or set drafter.attention to size this model as one")
        llada = {"d_model": "hidden_size", "mlp_hidden_size": "intermediate_size", "n_layers": "num_hidden_layers",
                 "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads"}
        sizes = {llada.get(k, k): v for k, v in config.items()}
        if config.get("num_experts"):  # a token passes its top-k experts (and a dense MLP where the model has one)
            sizes["intermediate_size"] = (config.get("top_k_experts", 1) * config["moe_intermediate_size"]
                                          + config.get("intermediate_size", 0))
        sizes.setdefault("logits_over_sequence", model_type == "llada")
        try:
            return _width_from_sizes({**sizes, "source": str(config_file)}, attention)
        except KeyError as e:
            raise RecipeError(f"drafter.path: {config_file} has no {e.args[0]}; align memory needs the layer sizes")
    if path in KNOWN_WIDTHS:
        return _width_from_sizes(KNOWN_WIDTHS[path], recipe.drafter.attention)
    raise RecipeError(f"drafter.path: {path} is neither a folder with a config.json nor a drafter align memory knows "
                      f"({', '.join(KNOWN_WIDTHS)}); point drafter.path at a folder holding its config.json")


def drafter_context(recipe: Recipe) -> Optional[int]:
    """The drafter's context in tokens, from its config.json where drafter.path is a folder (None: not known)."""
    config_file = Path(recipe.drafter.path) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    try:  # the rule every stage checks lengths by, read off the JSON as off a transformers config
        return context_length(SimpleNamespace(**config.get("text_config", config)))
    except RecipeError:
        return None


@dataclass(frozen=True)
class Shape:
    """One micro-batch as the drafter sees it."""
    rows: int  # sequences in the forward
    tokens: int  # tokens per row
    windows: int  # windows the losses read (rows × windows for block_causal, one per row for bidirectional)
    gamma: int
    trajectory_tokens: int  # prompt + completion tokens of a trajectory (capped by train.max_sequence_length)


def micro_batch_shape(recipe: Recipe, width: Width, trajectory_tokens: Optional[int] = None) -> Shape:
    """The largest micro-batch align/windows.py builds for the recipe: block_causal, one row per trajectory of its
    tokens plus windows × γ drafted ones; bidirectional, one row per window of up to the trajectory's tokens + γ − 1."""
    t = recipe.train
    if trajectory_tokens is None:
        trajectory_tokens = recipe.memory.prompt_tokens + recipe.trajectories.max_new_tokens
    if t.max_sequence_length is not None:
        trajectory_tokens = min(trajectory_tokens, t.max_sequence_length)
    windows = t.micro_batch_size * t.windows_per_sequence
    if width.attention == "block_causal":
        return Shape(t.micro_batch_size, trajectory_tokens + t.windows_per_sequence * t.gamma, windows, t.gamma,
                     trajectory_tokens)
    return Shape(windows, trajectory_tokens + t.gamma - 1, windows, t.gamma, trajectory_tokens)


def _dtype(recipe: Recipe) -> torch.dtype:
    return torch.bfloat16 if recipe.train.bf16 else torch.float32


def _layer(width: Width, recipe: Recipe) -> torch.nn.Module:
    """One decoder layer at the drafter's width (Llama's: attention, SwiGLU MLP, two RMSNorms), random weights;
    frozen with LoRA adapters when train.lora_r is set, as training has them."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(hidden_size=width.hidden_size, intermediate_size=width.intermediate_size,
                         num_attention_heads=width.num_attention_heads, num_key_value_heads=width.num_key_value_heads,
                         head_dim=width.head_dim, num_hidden_layers=1, vocab_size=width.vocab_size)
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, layer_idx=0).to(_dtype(recipe))
    if recipe.train.lora_r:
        from peft import LoraConfig, inject_adapter_in_model

        layer.requires_grad_(False)
        layer = inject_adapter_in_model(LoraConfig(r=recipe.train.lora_r, lora_alpha=recipe.train.lora_alpha,
                                                   target_modules=list(LORA_TARGETS)), layer)
    return layer


def _rotary(width: Width, shape: Shape, dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(shape.tokens, dtype=torch.float32, device=device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, width.head_dim, 2, dtype=torch.float32, device=device)
                                / width.head_dim))
    angles = torch.cat([positions[:, None] * inv_freq] * 2, -1)[None].expand(shape.rows, -1, -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@dataclass(frozen=True)
class Measured:
    """Bytes measured (on memory.device) for one micro-batch."""
    layer_kept: int  # what one layer keeps for its backward (its saved tensors and output), per layer
    layer_peak: int  # one layer's forward + backward peak
    layer_input: int  # one layer's input: all a checkpointed layer keeps
    head_and_losses_peak: int  # LM head over the windows (or the sequence), the recipe's losses, their backward


def measure(recipe: Recipe, width: Width, shape: Shape) -> Measured:
    """One layer and the LM head with the recipe's losses at `shape`, forward and backward, measured on
    memory.device (cpu: allocation_trace; cuda: cuda_allocation_trace)."""
    from align.losses import WINDOW_LOSSES, normalisation

    dtype, device = _dtype(recipe), recipe.memory.device
    trace = cuda_allocation_trace if device == "cuda" else allocation_trace
    torch.manual_seed(0)
    layer = _layer(width, recipe).to(device)
    rotary = _rotary(width, shape, dtype, device)
    hidden = torch.randn(shape.rows, shape.tokens, width.hidden_size, dtype=dtype, device=device).requires_grad_()
    layer_input = hidden.numel() * hidden.element_size()
    _, kept, out = trace(lambda: layer(hidden, attention_mask=None, position_embeddings=rotary))
    del out

    def layer_step() -> None:
        layer(hidden, attention_mask=None, position_embeddings=rotary).sum().backward()

    layer_peak, _, _ = trace(layer_step)
    del layer, hidden

    head = torch.nn.Linear(width.hidden_size, width.vocab_size, bias=False, dtype=dtype, device=device)
    head.requires_grad_(not recipe.train.lora_r)  # peft's all-linear leaves the output layer out
    positions = shape.rows * shape.tokens if width.logits_over_sequence else shape.windows * shape.gamma
    head_hidden = torch.randn(positions, width.hidden_size, dtype=dtype, device=device).requires_grad_()
    targets = torch.randint(0, width.vocab_size, (shape.windows, shape.gamma), device=device)
    mask = torch.ones(shape.windows, shape.gamma, dtype=torch.bool, device=device)
    offline_kd = any(WINDOW_LOSSES[n][1] == "verifier_logits" for n in recipe.train.losses) and \
        not recipe.train.labels_online()
    # Offline, align/windows.py rebuilds the verifier's top-k as dense fp32 [windows, γ, V] logits; online the
    # verifier's own logits arrive in its dtype.
    verifier_logits = (torch.randn(shape.windows, shape.gamma, width.vocab_size,
                                   dtype=torch.float32 if offline_kd else dtype, device=device)
                       if any(WINDOW_LOSSES[n][1] == "verifier_logits" for n in recipe.train.losses) else None)

    def head_and_losses() -> None:
        logits = head(head_hidden)
        if width.logits_over_sequence:  # windows are read out of the whole sequence's logits
            logits = logits[: shape.windows * shape.gamma]
        logits = logits.view(shape.windows, shape.gamma, width.vocab_size)
        total = 0.0
        for name, weight in recipe.train.losses.items():
            fn, against = WINDOW_LOSSES[name]
            other = targets if against == "targets" else verifier_logits
            count = normalisation(name, shape.windows, shape.windows * shape.gamma)
            total = total + weight * fn(logits, other, mask, **count)
        total.backward()

    head_peak, _, _ = trace(head_and_losses)
    return Measured(kept, layer_peak, layer_input, head_peak)



def lora_parameters(width: Width, rank: int) -> int:
    """Trainable parameters of LoRA rank `rank` on every linear layer of every decoder layer: r·(in + out) each."""
    heads, kv_heads = width.num_attention_heads * width.head_dim, width.num_key_value_heads * width.head_dim
    attention = [(width.hidden_size, heads), (width.hidden_size, kv_heads), (width.hidden_size, kv_heads),
                 (heads, width.hidden_size)]  # q, k, v, o
    mlp = [(width.hidden_size, width.intermediate_size)] * 2 + [(width.intermediate_size, width.hidden_size)]
    return width.num_hidden_layers * rank * sum(a + b for a, b in attention + mlp)


@dataclass(frozen=True)
class PerGpu:
    """Bytes per GPU at the peak of a training step."""
    weights: int
    gradients: int
    optimizer: int
    gathered: int  # ZeRO-3: one layer's (or the LM head's) parameters gathered whole for its forward/backward
    activations: int
    total: int
    verifier: int = 0  # the verifier's weights beside the drafter (verifier_held says which part)


def verifier_held(recipe: Recipe) -> str:
    """Which part of the verifier a training rank holds beside the drafter, outside DeepSpeed (never partitioned):
    "whole" where the step runs it (online or on-policy labels; a DFlash drafter's states, unless precomputed),
    "ends" (its embeddings and head: load_verifier_ends) with states.out, "none" offline."""
    # A new DFlash drafter reads the verifier's states; drafter.path's drafters are standalone wherever align memory
    # measures them (drafter_width refuses others), read from config.json alone, so no weights are checked here.
    if TrainedDrafter.of(recipe).is_new_dflash:
        return "ends" if recipe.states.out is not None else "whole"
    return "whole" if recipe.train.labels_online() else "none"


def verifier_bytes(recipe: Recipe) -> int:
    """Bytes of the verifier weights `verifier_held` names, counted from its config on the meta device (no weights
    read), in the dtype it runs in on a GPU."""
    held = verifier_held(recipe)
    if held == "none":
        return 0
    from transformers import AutoModelForCausalLM

    from align.models import resolve_dtype
    from align.preflight import load_model_config

    v = recipe.verifier
    config = load_model_config("verifier.path", v)
    if held == "ends":  # as load_verifier_ends builds it (set after the config's own checks of its layer lists)
        config = copy.deepcopy(config)
        config.get_text_config().num_hidden_layers = 0
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=v.trust_remote_code)
    dtype = resolve_dtype(v.dtype, torch.device("cuda"), v.path, v.trust_remote_code)
    return sum(p.numel() for p in model.parameters()) * torch.empty((), dtype=dtype).element_size()


def per_gpu(recipe: Recipe, width: Width, measured: Measured) -> PerGpu:
    """The peak per GPU, extrapolated from one measured layer.

    Model states as DeepSpeed keeps them: bf16 (or fp32) weights; gradients in the accumulation dtype (fp32 under
    ZeRO with bf16 unless train.grad_accum_dtype says bf16); AdamW's two fp32 moments, plus fp32 master weights under
    bf16. ZeRO 1 shards the optimizer states over the ranks, 2 also the gradients, 3 also the weights.
    Activations: every layer keeps what it saved for the backward (with activation checkpointing only its input)
    while the LM head, the losses and then the last layer's backward run on top.
    """
    t, world = recipe.train, recipe.memory.world_size
    weight_bytes = 2 if t.bf16 else 4
    accumulate = t.grad_accum_dtype or ("fp32" if t.zero_stage >= 1 else "bf16")
    grad_bytes = 4 if (not t.bf16 or accumulate == "fp32") else 2
    optimizer_bytes = 12 if t.bf16 else 8
    trainable = lora_parameters(width, t.lora_r) if t.lora_r else width.parameters
    weights = width.parameters * weight_bytes // (world if t.zero_stage == 3 else 1)
    gradients = trainable * grad_bytes // (world if t.zero_stage >= 2 else 1)
    optimizer = trainable * optimizer_bytes // (world if t.zero_stage >= 1 else 1)
    layer_params = (width.parameters - width.vocab_size * width.hidden_size) // width.num_hidden_layers
    gathered = max(layer_params, width.vocab_size * width.hidden_size) * weight_bytes if t.zero_stage == 3 else 0
    if t.activation_checkpointing:  # the backward recomputes one layer at a time, whole
        activations = width.num_hidden_layers * measured.layer_input + max(measured.head_and_losses_peak,
                                                                          measured.layer_peak)
    else:
        activations = width.num_hidden_layers * measured.layer_kept + max(
            measured.head_and_losses_peak, measured.layer_peak - measured.layer_kept)
    verifier = verifier_bytes(recipe)
    total = weights + gradients + optimizer + gathered + activations + verifier
    return PerGpu(weights, gradients, optimizer, gathered, activations, total, verifier)


def peak_per_gpu(recipe: Recipe, world_size: int) -> PerGpu:
    """What `align memory` reports, as numbers: one layer measured on the CPU at the recipe's width and micro-batch,
    extrapolated to a rank of `world_size` under the recipe's ZeRO stage. RecipeError where the drafter's sizes are
    unknown (drafter_width)."""
    recipe = recipe.model_copy(update={"memory": recipe.memory.model_copy(update={"world_size": world_size})})
    width = drafter_width(recipe)
    return per_gpu(recipe, width, measure(recipe, width, micro_batch_shape(recipe, width)))


# The warning `align train` gives before it starts, from the measurement above.
# Set in the environment once `align train`'s memory warning has been considered, so that the ranks a launch starts
# (which inherit it, and run the same checks) do not measure again.
MEMORY_CHECKED = "ALIGN_TRAIN_MEMORY_CHECKED"


def warn_train_memory(recipe: Recipe, peak_per_gpu: Callable[[Recipe, int], int]) -> None:
    """Warn (one line on stderr, never a refusal) when `align memory`'s measured peak per GPU for this recipe exceeds
    the memory of the GPU this process trains on. peak_per_gpu(recipe, world_size): bytes, `align memory`'s
    measurement (align.memory_probe.peak_per_gpu, in bytes). Only where CUDA is
    available: it measures one layer at the real width on the CPU (seconds to minutes), not worth paying on a
    CPU-only host. Runs once per launch: in the process the user started (its ranks inherit MEMORY_CHECKED) or,
    under a hand-started launcher, on rank 0."""
    if os.environ.get(MEMORY_CHECKED) or os.environ.get("RANK", "0") != "0" or \
            not TrainedDrafter.of(recipe).memory_modelled:
        return  # a DFlash drafter is not modelled by align memory
    if not torch.cuda.is_available():
        return
    os.environ[MEMORY_CHECKED] = "1"
    # Under a launcher the world is known; in the process that starts one it is the recipe's (memory.world_size).
    world = int(os.environ.get("WORLD_SIZE", recipe.memory.world_size))
    device = int(os.environ.get("LOCAL_RANK", 0))
    try:
        need = peak_per_gpu(recipe, world)
    except RecipeError:  # sizes align memory does not know: nothing measured, nothing to say
        return
    gpu = torch.cuda.get_device_properties(device)
    if need <= gpu.total_memory:
        return
    t = recipe.train
    changes = ([f"train.zero_stage={t.zero_stage + 1}"] if t.zero_stage < 3 else []) + \
        (["train.activation_checkpointing=true"] if not t.activation_checkpointing else []) + \
        ([f"a smaller train.micro_batch_size (now {t.micro_batch_size})"] if t.micro_batch_size > 1 else []) + \
        [f"a lower train.max_sequence_length (now {t.max_sequence_length})" if t.max_sequence_length else
         "a train.max_sequence_length cap"]
    print(f"align train: warning: align memory measures a peak of {need / 1e9:.1f} GB per GPU (ZeRO-{t.zero_stage} "
          f"over {world} ranks) but cuda:{device} ({gpu.name}) has {gpu.total_memory / 1e9:.1f} GB; it may run out "
          f"of memory: try {', '.join(changes)}", file=sys.stderr, flush=True)
