"""The recipe schema: the only home of defaults.

A recipe is a YAML file whose top-level keys are the sections below. Every stage command takes
`recipe.yaml key.sub=value ...` overrides, which are applied to the parsed YAML *before* validation, so a YAML value
and a command-line value go through exactly the same checks. Anything wrong (unknown key, wrong type, impossible value,
missing input) raises `RecipeError` with one line naming the key and what is allowed; the CLI turns that into exit
code 2 before any work starts.

Each field is documented once, in the comment above it. The input stages' sections (convert, prompts, sharegpt,
derive, pretrain, bootstrap) are in align/config_inputs.py, part of this schema. Reading a recipe file and its
overrides is align/recipe_files.py's; what a recipe names (models, files, output folders, the context rule) is checked in
align/preflight.py; the model families and the DrafterSpec are in align/drafters/spec.py.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from align.config_inputs import BootstrapSection, ConvertSection, DeriveSection, PromptsSection, ShareGPTSection
from align.decoding.options import METHOD_NAMES
from align.hub import HUB_LICENSES
from align.recipe_fields import (LOSSES, Device, Dtype, LearningRate, LossName, MethodName, PositiveTemperature,
                                 PromptSource, ReportTo, Section, Seed, Temperature, TrackerProject)


class RecipeError(ValueError):
    """A recipe or override the user must fix. Its message is one line, shown without a traceback."""


# --------------------------------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------------------------------
class ModelSection(Section):
    #: local HF folder or a Hub id (org/name)
    path: str
    #: "device": bfloat16 on CUDA, float32 on CPU (batch-1 decoding is no faster in bf16 on CPU, and fp32 is exact);
    #: "auto": the checkpoint's own dtype (its config.json's, as in transformers and vLLM); or float32, bfloat16, float16
    dtype: Dtype = "device"
    #: "auto": CUDA when available, else CPU
    device: Device = "auto"
    #: Hub dLLMs (LLaDA, Dream, DiffuCoder) ship their own modelling code
    trust_remote_code: bool = False
    #: attention kernel handed to transformers; sdpa and eager both honour the 4-D masks the runtime builds
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"


class VerifierSection(ModelSection):
    path: str = "checkpoints/tiny/verifier"


class DrafterSection(ModelSection):
    path: str = "checkpoints/tiny/drafter-base"
    # The DrafterSpec is read from the drafter's config.json (`drafter_spec`, or the fields real dLLMs ship, such as
    # `mask_token_id`). The three fields below override it, for Hub models whose config does not say.
    #: id of the mask token; None: from the config, else the tokenizer's mask token
    mask_token_id: Optional[int] = Field(default=None, ge=0)
    #: 0: position t's prediction is at logits[t] (LLaDA); 1: at logits[t-1] (Dream, DiffuCoder); None: from config
    logits_shift: Optional[Literal[0, 1]] = None
    #: None: from the config
    attention: Optional[Literal["bidirectional", "block_causal"]] = None


class DFlashSection(Section):
    """A new DFlash drafter (target-conditioned block diffusion, align/drafters/dflash.py) shaped to the verifier:
    `align train` starts from it, with random weights, instead of loading drafter.path."""

    #: draft decoder layers
    num_layers: int = Field(default=1, ge=1)
    #: MLP width of a draft layer; None: the verifier's
    intermediate_size: Optional[int] = Field(default=None, ge=8)
    #: verifier layers whose hidden states condition the drafter (speculators' aux_hidden_state_layer_ids: id k is the
    #: residual stream entering verifier layer k, 0 the embeddings); None: three spread over the verifier's layers
    aux_layer_ids: Optional[list[Annotated[int, Field(ge=0)]]] = Field(default=None, min_length=1)
    #: block size written for serving (anchor + drafted tokens: vLLM drafts block_size - 1); None: train.gamma + 1
    block_size: Optional[int] = Field(default=None, ge=2)
    #: the token marking masked positions; None: the tokenizer's mask token, else one align chooses and says
    #: (align/drafters/mask_token.py: an embedding row past the vocabulary, or an unused special token)
    mask_token_id: Optional[int] = Field(default=None, ge=0)
    # Kangaroo and LayerSkip draft with the verifier's own layers: a draft layer that starts as one of them reads and
    # writes the verifier's residual space from step 0, which may lift a drafter short of data.
    #: the verifier layers the draft layers start from, one per draft layer in order (their attention, MLP and norm
    #: weights; the draft's q/k norms start at 1, `fc` random); None: random draft layers (the DFlash paper's)
    init_from_layers: Optional[list[Annotated[int, Field(ge=0)]]] = Field(default=None, min_length=1)
    #: a pruned draft vocabulary (EAGLE-3's and speculators' d2t/t2d, which vLLM serves): the drafter's own LM head
    #: over this many of the verifier's tokens, the most frequent in the training trajectories' completions, started
    #: as the verifier's rows; None: the verifier's whole LM head
    draft_vocab_size: Optional[int] = Field(default=None, ge=2)

    @model_validator(mode="after")
    def _check_init(self) -> "DFlashSection":
        if self.init_from_layers is not None and len(self.init_from_layers) != self.num_layers:
            raise ValueError(f"init_from_layers names {len(self.init_from_layers)} verifier layers for "
                             f"{self.num_layers} draft layers (num_layers): one each")
        return self


class ArDrafterSection(ModelSection):
    path: str = "checkpoints/tiny/ar-drafter"


# --------------------------------------------------------------------------------------------------------------------
# data, trajectories
# --------------------------------------------------------------------------------------------------------------------
class DataSection(Section):
    #: where the tiny corpus and prompt sets live; built from the stdlib by `align bootstrap` or the first stage that
    #: needs them
    dir: str = "data/tiny"
    #: prompts for trajectories: a local JSONL or Parquet file, a local dataset folder in the Hub layout
    #: (data/train-00000-of-00001.parquet), or a Hub dataset id (org/name), all read with `datasets`; or a mixture,
    #: a list of sources ({path, name, data_files, revision, split, prompt_column, weight}) from which
    #: trajectories.num_prompts are drawn by weight; None: the tiny train split (evaluation prompts are eval.prompts,
    #: calibration prompts calibrate.prompts)
    train_prompts: Optional[Union[str, Annotated[list[PromptSource], Field(min_length=1)]]] = None
    #: the split of data.train_prompts read (a folder or Hub id; a single file is its only split)
    train_split: str = "train"
    #: the column holding each prompt: a string, or chat messages ({role, content}); a conversation that ends with
    #: assistant turns is cut before them, leaving the prompt the verifier answers
    prompt_column: str = "prompt"
    #: render prompts with the chat template of the tokenizer that reads them (the verifier's; the dLLM's in
    #: calibration and dllm eval), in every stage alike: auto: when that tokenizer has one (instruct models); on: it
    #: must have one; off: plain text
    chat_template: Literal["auto", "on", "off"] = "auto"

    @field_validator("chat_template", mode="before")
    @classmethod
    def _on_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `on` / `off` as true / false: take them back as the words the user wrote.
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class TrajectoriesSection(Section):
    #: output folder of Arrow shards and manifest.json
    out: str = "data/tiny/trajectories"
    # SpecDiff-2's defaults: a slightly cool, nucleus-truncated verifier gives varied but typical continuations.
    #: verifier sampling temperature
    temperature: Temperature = Field(default=0.5, ge=0.0)
    #: nucleus mass kept when sampling
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    #: completions sampled per prompt
    completions_per_prompt: int = Field(default=4, ge=1)
    #: new tokens per completion
    max_new_tokens: int = Field(default=128, ge=1)
    #: prompts used; None: all
    num_prompts: Optional[int] = Field(default=None, ge=1)
    #: verifier top-k log-probs stored per completion position, for KD losses; 0: none
    store_topk: int = Field(default=0, ge=0)
    #: prompts per verifier batch; chunks are cut from the prompts longest first, so that a batch is padded to
    #: lengths alike and the first chunk meets the largest memory need
    batch_size: int = Field(default=8, ge=1)
    #: prompts of more tokens than this (as the verifier reads them, chat template included) are left out and
    #: counted; None: every prompt the verifier's context holds. One long prompt pads its whole batch to its length
    max_prompt_tokens: Optional[int] = Field(default=None, ge=1)
    # vLLM batches continuously and is faster for large runs; it runs in its own environment (launch/setup_vllm.sh).
    # Greedy float32 completions are token-identical between the two; sampled ones differ (other random streams).
    #: who generates the completions: hf (transformers generate) or vllm
    backend: Literal["hf", "vllm"] = "hf"
    #: with backend vllm on a CPU, memory vLLM reserves for its KV cache, in GiB (on a GPU vLLM sizes it itself)
    vllm_cpu_kv_cache_gib: float = Field(default=1.0, gt=0.0)

    @model_validator(mode="after")
    def _check(self) -> "TrajectoriesSection":
        if self.temperature == 0 and self.completions_per_prompt > 1:
            raise ValueError("completions_per_prompt > 1 needs temperature > 0: greedy completions are all the same")
        return self


class StatesSection(Section):
    """`align states`: the verifier's hidden states a DFlash drafter reads, computed once for every trajectory."""

    #: folder of the states (chunks of raw values with manifests, as speculators and SpecForge precompute them);
    #: set: `align states` writes it and `align train` reads it, loading no verifier on its ranks (its embeddings and
    #: LM head only, which a DFlash drafter shares); None: the states are computed in every step
    out: Optional[str] = None
    #: trajectories per verifier forward (rows of alike lengths are batched together)
    batch_size: int = Field(default=8, ge=1)
    # A 7B verifier's 4 layers of 3,584 values in bf16 are 28 KiB a token: a 1 GiB chunk holds ~37k tokens.
    #: size of a chunk's file, in MiB (at least one trajectory): the unit of resuming and of the stage's memory (a
    #: chunk is gathered in memory, then written)
    chunk_mib: float = Field(default=1024.0, gt=0.0)


# --------------------------------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------------------------------
class TrainSection(Section):
    #: run folder: step_<N>/ merged HF folders, ds_state/, metrics.jsonl
    out: str = "checkpoints/tiny-align"
    #: loss name -> weight (> 0); names are those of align/losses.py
    losses: dict[LossName, Annotated[float, Field(gt=0.0, allow_inf_nan=False)]] = Field(
        default_factory=lambda: {"streak": 1.0}, min_length=1)
    #: draft length of a training window
    gamma: int = Field(default=16, ge=1)
    #: windows drawn from each trajectory per step (a block-causal drafter trains them in one forward)
    windows_per_sequence: int = Field(default=4, ge=1)
    #: offline: stored trajectories; online: verifier labels inside the step; on_policy: drafter proposes, verifier
    #: labels; rejections (DFlash, Draft-OPD): the anchors greedy decoding visits, where verification rejected a draft
    data_mode: Literal["offline", "online", "on_policy", "rejections"] = "offline"
    #: optimiser steps
    max_steps: int = Field(default=200, ge=1)
    #: peak learning rate (AdamW)
    lr: LearningRate = 1e-4
    weight_decay: float = Field(default=0.0, ge=0.0)
    warmup_steps: int = Field(default=10, ge=0)
    #: sequences per rank per micro-step
    micro_batch_size: int = Field(default=4, ge=1)
    #: windows are drawn only from the first N tokens of each trajectory's prompt + completion (their labels too), so
    #: a forward reads at most N tokens plus the drafted blocks; a trajectory whose prompt fills the N tokens gives no
    #: window. None: the whole trajectory
    max_sequence_length: Optional[int] = Field(default=None, ge=2)
    #: recompute each drafter layer's activations in the backward instead of keeping them (transformers'
    #: gradient_checkpointing_enable): less memory per token for about a third more compute; refused for a drafter
    #: whose class does not support it
    activation_checkpointing: bool = False
    #: a DFlash run: keep each trajectory's verifier hidden states in a file under train.out after its first step
    #: (removed when the run ends), so that later epochs read them instead of running the verifier (speculators'
    #: offline mode, filled as the run goes), with its final states too where a KD loss reads its logits; only with
    #: offline data and every rank on one machine
    cache_verifier_states: bool = False
    #: processes of each rank that build the next steps' batches (windows, masks, precomputed states) while a step
    #: runs, in pinned memory on a GPU (align/batches.py); 0: the loop builds each when it needs it. None: 1 where the
    #: rank trains on a GPU, else 0 (on a CPU the ranks use every core already)
    batch_workers: Optional[int] = Field(default=None, ge=0)
    gradient_accumulation_steps: int = Field(default=1, ge=1)
    #: gradient-norm clip; 0: off
    grad_clip: float = Field(default=1.0, ge=0.0)
    #: DeepSpeed ZeRO stage
    zero_stage: Literal[0, 1, 2, 3] = 0
    #: your DeepSpeed JSON config, merged with what align derives from this section (micro batch, accumulation,
    #: clipping, ZeRO stage, bf16, the accumulation dtype): its other keys apply (ZeRO-Offload of optimizer state or
    #: parameters, communication and bucket sizes, ...); a key align derives set to another value, an optimizer or a
    #: scheduler (align builds AdamW and the cosine schedule from train.lr) is refused naming the key. None: align's own
    deepspeed_config: Optional[str] = None
    bf16: bool = True
    #: under bf16, the dtype gradients are accumulated (and reduced) in across micro-batches: fp32 or bf16; None:
    #: fp32 with ZeRO (stages 1-3), bf16 at stage 0, where DeepSpeed has no fp32 accumulation for bf16 weights
    grad_accum_dtype: Optional[Literal["fp32", "bf16"]] = None
    #: LoRA rank; 0: full fine-tuning
    lora_r: int = Field(default=0, ge=0)
    lora_alpha: float = Field(default=16.0, gt=0.0)
    seed: Seed = 0
    #: save a checkpoint every N steps (and at the end)
    save_every: int = Field(default=100, ge=1)
    #: after each save, keep this many newest checkpoints (step_<N>/ and ds_state/step_<N>/), deleting older ones;
    #: None: keep every one
    keep_last: Optional[int] = Field(default=None, ge=1)
    #: over several machines: a rank that has not been heard from for this many seconds (its node lost, frozen or
    #: cut off) stops every other node's ranks, instead of their waiting out the collectives' timeout (30+ minutes)
    peer_silence_s: float = Field(default=60.0, gt=0.0, allow_inf_nan=False)
    #: held-out simulated accepted length every N steps
    eval_every: int = Field(default=50, ge=1)
    #: the held-out metric reads at most this many held-out trajectories, the same seeded sample at every eval;
    #: None: all of them
    held_out_max_rows: Optional[int] = Field(default=256, ge=1)
    #: at the end, real τ of SpecDiff greedy decoding on this many held-out prompts (64 new tokens); 0: skip
    final_eval_prompts: int = Field(default=8, ge=0)
    #: experiment trackers of the training metrics, named as transformers' report_to: tensorboard (events in
    #: <out>/tensorboard), wandb (<out>/wandb; WANDB_MODE=offline logs without an account), trackio (its local store:
    #: $TRACKIO_DIR, default ~/.cache/huggingface/trackio), a list of them, all (every one installed) or none
    report_to: ReportTo = Field(default_factory=lambda: ["tensorboard"])
    #: the project the run is filed under in wandb and trackio
    project: TrackerProject = "align"
    #: the run's name in the trackers; None: the name of the run folder (train.out)
    run_name: Optional[str] = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _check(self) -> "TrainSection":
        if self.grad_accum_dtype is not None and not self.bf16:
            raise ValueError(f"grad_accum_dtype={self.grad_accum_dtype} applies to bf16 training only; with "
                             "bf16=false gradients are fp32 (leave grad_accum_dtype unset)")
        if self.grad_accum_dtype == "fp32" and self.zero_stage == 0:
            raise ValueError("grad_accum_dtype=fp32 with bf16 needs zero_stage >= 1 (DeepSpeed accumulates bf16 "
                             "weights' gradients in bf16 without ZeRO); set zero_stage, or leave grad_accum_dtype "
                             "unset")
        return self

    def reads_verifier_distributions(self) -> bool:
        """Whether a loss of the recipe reads the verifier's distributions, not its tokens alone (LOSSES says which)."""
        return any(LOSSES[name].reads == "verifier_logits" for name in self.losses)

    def labels_online(self) -> bool:
        """Whether the verifier runs inside the training step: on-policy, or online with a loss that reads its
        distributions."""
        return self.data_mode == "on_policy" or (self.data_mode == "online" and self.reads_verifier_distributions())


class GkdSection(Section):
    """The DistillSpec baseline: the AR drafter distilled from the verifier with TRL's GKD trainer."""

    #: run folder; the distilled drafter lands in <out>/final
    out: str = "checkpoints/tiny-gkd"
    #: probability of training on the drafter's own samples (on-policy; DistillSpec's lesson)
    lmbda: float = Field(default=0.5, ge=0.0, le=1.0)
    #: generalised JSD interpolation: 0 forward KL, 1 reverse KL
    beta: float = Field(default=0.5, ge=0.0, le=1.0)
    max_steps: int = Field(default=100, ge=1)
    lr: LearningRate = 1e-4
    batch_size: int = Field(default=8, ge=1)
    #: length of the drafter's on-policy samples
    max_new_tokens: int = Field(default=64, ge=1)
    seed: Seed = 0
    #: experiment trackers, as train.report_to; TRL's trainer writes tensorboard events under <out>/runs
    report_to: ReportTo = Field(default_factory=lambda: ["tensorboard"])
    #: the project the run is filed under in wandb and trackio
    project: TrackerProject = "align"
    #: the run's name in the trackers; None: the name of the run folder (gkd.out)
    run_name: Optional[str] = Field(default=None, min_length=1)


# --------------------------------------------------------------------------------------------------------------------
# decoding, calibration, evaluation, export
# --------------------------------------------------------------------------------------------------------------------
class DecodeSection(Section):
    #: draft length (bounded, as num_candidates and tree_nodes are: tree_nodes=10**6 grew a process to 23 GB)
    gamma: int = Field(default=8, ge=1, le=256)
    #: verifier sampling temperature; 0: greedy (outputs identical to AR greedy)
    temperature: Temperature = Field(default=0.0, ge=0.0)
    #: 0: no top-k truncation
    top_k: int = Field(default=0, ge=0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(default=64, ge=1)
    #: at temperature > 0, what a SpecDiff draft is: sample (tokens drawn from the drafter's distribution, accepted
    #: with probability min(1, p/q)) or argmax (its most likely tokens, accepted by the point-mass rule); both are
    #: lossless; sample kept more at temperatures 0.7 and 1.0 with the tiny aligned drafter (the README's table)
    draft_choice: Literal["sample", "argmax"] = "sample"
    #: SpecDiff-2 self-selection: drafts drawn from one drafter pass and verified together
    num_candidates: int = Field(default=4, ge=1, le=64)
    #: drafter temperature for self-selection (SpecDiff-2 samples hot, ~1.5-2, for diverse candidates)
    draft_temperature: PositiveTemperature = Field(default=1.5, gt=0.0)
    seed: Seed = 0
    # DiffuSpec causal-consistency path search (defaults from the paper).
    #: beams kept while searching the draft path
    cps_beam_width: int = Field(default=3, ge=1)
    #: per position, keep the smallest top-m set with at least this drafter mass
    cps_threshold: float = Field(default=0.8, gt=0.0, le=1.0)
    #: and at most this many tokens
    cps_max_candidates: int = Field(default=15, ge=1)
    #: weight of the drafter's log-probability against the causal proxy's
    cps_weight: float = Field(default=0.5, ge=0.0, le=1.0)
    #: what the trigram proxy is fitted on: text (JSONL with a `text` field), or a trajectories folder (the verifier's
    #: own continuations: the proxy for an aligned drafter); None: the tiny corpus's train split
    cps_proxy_corpus: Optional[str] = None
    # DiffuSpec adaptive draft length. The paper's 20-30 (δ 10) suit 7B models whose drafts run long; the tiny
    # family's accepted lengths are a few tokens.
    adl_min_len: int = Field(default=2, ge=1)
    adl_max_len: int = Field(default=16, ge=1)
    adl_delta: int = Field(default=4, ge=0)
    #: EMA rate of the generated and accepted lengths
    adl_rho: float = Field(default=0.5, gt=0.0, le=1.0)
    #: specdiff_tree, specdiff_cps_tree: draft-tree nodes verified per forward besides the root (the tree is at most
    #: γ deep); K·γ matches the verifier tokens of self-selection with K candidates. specdiff_tree_cost,
    #: specdiff_cps_tree_cost: the largest tree, of which each step verifies the nodes that pay for their cost
    tree_nodes: int = Field(default=32, ge=1, le=1024)
    #: tokens HF prompt lookup proposes after a match (it matches at most 2 tokens, HF's max_matching_ngram_size)
    prompt_lookup_tokens: int = Field(default=10, ge=1)
    # vLLM's n-gram speculator's defaults (prompt_lookup_max 4, prompt_lookup_min 1): a longer match predicts better,
    # and a single token still finds the names and numbers a question holds.
    #: ngram, specdiff_ngram_tree: the longest suffix of the context (prompt and output so far) looked up among its
    #: earlier tokens; the draft is the γ tokens after the most recent occurrence of the longest one found
    ngram_max_match: int = Field(default=4, ge=1)
    #: and the shortest; nothing matching, no draft: a plain verifier step
    ngram_min_match: int = Field(default=1, ge=1)
    # SuffixDecoding's defaults, scaled to short chat answers: its trees are built from up to 64-token matches over
    # agentic traces; on a chat verifier's trajectories an 8-token match is already specific.
    #: suffix, specdiff_suffix_tree: the trajectories folder (`align trajectories`' out) whose prompts and answers the
    #: suffix index is built over, or a folder holding one saved (`align export` writes suffix_index.npz beside the
    #: drafter when this is set); required by those methods
    suffix_corpus: Optional[str] = None
    #: the longest suffix of the context looked up in it
    suffix_max_match: int = Field(default=8, ge=1)
    #: the most candidate nodes it adds to a tree (the most frequent continuations)
    suffix_nodes: int = Field(default=16, ge=1)
    #: a continuation taken by fewer than this share of the matches is not proposed
    suffix_min_share: float = Field(default=0.1, gt=0.0, le=1.0)
    # Cost-aware sizes follow seconds measured as the run goes, so a seeded sampled run draws differently each time
    # (each output still follows the verifier's distribution); recorded costs make it reproducible.
    #: seconds of a verifier forward over n = 1..max(γ, tree_nodes) + 1 new tokens (eval.json's meta.verify_costs_s)
    verify_costs_s: Optional[list[Annotated[float, Field(gt=0.0)]]] = None
    #: seconds of a drafter pass (a skipped one's model-free lookup then counts as 0); None: measured as they run
    draft_cost_s: Optional[float] = Field(default=None, gt=0.0)

    @model_validator(mode="after")
    def _check(self) -> "DecodeSection":
        most = max(self.gamma, self.tree_nodes) + 1
        if self.verify_costs_s is not None and len(self.verify_costs_s) < most:
            raise ValueError(f"verify_costs_s holds {len(self.verify_costs_s)} costs; a draft of up to "
                             f"max(gamma, tree_nodes) = {most - 1} tokens needs {most} (n = 1..{most})")
        if self.adl_min_len > self.adl_max_len:
            raise ValueError(f"adl_min_len ({self.adl_min_len}) must not exceed adl_max_len ({self.adl_max_len})")
        if self.ngram_min_match > self.ngram_max_match:
            raise ValueError(f"ngram_min_match ({self.ngram_min_match}) must not exceed ngram_max_match "
                             f"({self.ngram_max_match})")
        return self


class CalibrateSection(Section):
    #: folder that receives draft_graph.json
    out: str = "checkpoints/tiny-spiffy"
    #: a calibrated draft_graph.json to decode with; None: none
    graph: Optional[str] = None
    #: calibration prompts (Spiffy: 20-50 suffice)
    num_prompts: int = Field(default=30, ge=1)
    #: draft states per forward (the graph's node budget D)
    budget: int = Field(default=10, ge=1)
    #: semi-autoregressive block length of the dLLM
    block_length: int = Field(default=32, ge=1)
    #: tokens unmasked per vanilla step
    tokens_per_step: int = Field(default=1, ge=1)
    #: confidence threshold of the parallel-unmasking methods (Fast-dLLM's 0.9)
    threshold: float = Field(default=0.9, gt=0.0, le=1.0)
    #: formulas may name the i-th masked position (in the graph's order) up to this rank...
    max_position_rank: int = Field(default=8, ge=1)
    #: ... and its j-th most likely token up to this rank
    max_token_rank: int = Field(default=3, ge=1)
    #: how formulas rank masked positions: confidence (Spiffy's), nearest (to the last unmasked position), or auto
    #: (calibrate both, keep the graph that saves more forwards on the calibration traces)
    position_order: Literal["auto", "confidence", "nearest"] = "auto"
    #: node search: simulated (the forwards the graph saves, replayed on the calibration traces) or degree1 (Spiffy's
    #: degree-1 accumulation proxy for them)
    objective: Literal["simulated", "degree1"] = "simulated"
    #: calibration prompts, any source data.train_prompts takes (file, Hub-layout folder, Hub id); None: the tiny
    #: train split
    prompts: Optional[str] = None
    #: the split of calibrate.prompts read (a folder or Hub id; a single file is its only split)
    split: str = "train"
    #: the column of calibrate.prompts holding each prompt (a string or chat messages, as data.prompt_column)
    prompt_column: str = "prompt"


class EvalSection(Section):
    #: speculative: a drafter for an AR verifier (METHOD_NAMES); dllm: the drafter decoded as a diffusion LM, vanilla
    #: against Spiffy (needs calibrate.graph) and threshold decoding
    mode: Literal["speculative", "dllm"] = "speculative"
    #: Spiffy budgets evaluated in dllm mode: the first D nodes of the calibrated graph
    spiffy_budgets: list[int] = Field(default_factory=lambda: [3, 5, 8, 10])
    #: dynamic pruning (Spiffy v4): for each k, `pruned_spiffy_d<D>_a<k>` evaluates the k most likely of the largest
    #: budget's D drafts per forward
    spiffy_active: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list)
    #: evaluation prompts, any source data.train_prompts takes (file, Hub-layout folder, Hub id); None: the tiny
    #: test split
    prompts: Optional[str] = None
    #: the split of eval.prompts read (a folder or Hub id; a single file is its only split)
    split: str = "test"
    #: the column holding the prompt: a string, chat messages (as data.prompt_column), or a list of strings (as
    #: Spec-Bench's `turns`: its first element)
    prompt_column: str = "prompt"
    #: the dataset config (subset) of eval.prompts, as `datasets.load_dataset`'s second argument: GSM8K's `main`;
    #: None: the dataset's only (or default) config
    dataset_config: Optional[str] = None
    #: keep only the rows whose `category` column is one of these (Spec-Bench / MT-Bench: writing, coding, math,
    #: translation, ...); empty: every row
    categories: list[str] = Field(default_factory=list)
    #: the column holding each prompt's stable id, recorded in eval.json (HumanEval's `task_id`); None: the first of
    #: task_id, question_id, prompt_id, id that the rows hold, else the sha256 of the prompt's token ids
    id_field: Optional[str] = None
    #: output folder: eval.json, report.md, plots
    out: str = "checkpoints/tiny-eval"
    #: prompts evaluated; None: all
    num_prompts: Optional[int] = Field(default=None, ge=1)
    #: untimed generations before timing starts
    warmup: int = Field(default=2, ge=0)
    # The suffix methods read a trajectories folder (decode.suffix_corpus) a recipe may not have: named, not default.
    #: methods compared (names of align/methods.py's METHODS); the AR baseline always runs; unset: every method but
    #: the suffix ones
    methods: list[MethodName] = Field(default_factory=lambda: [n for n in METHOD_NAMES if "suffix" not in n])
    #: temperature of the sampled run (reported under `sampling`); 0: greedy run only
    sampling_temperature: Temperature = Field(default=1.0, ge=0.0)
    #: timed runs per prompt and method; the median is kept
    repeats: int = Field(default=1, ge=1)
    #: more diffusion drafters (label -> path) run in the same interleaved run as drafter.path, e.g. before and after
    #: alignment; their methods are reported as `<method>@<label>`
    compare_drafters: dict[str, str] = Field(default_factory=dict)

    @field_validator("compare_drafters")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for label in value:
            if not label or not all(c.isalnum() or c in "-_." for c in label):
                raise ValueError(f"label '{label}' must be letters, digits, '-', '_' or '.'")
        return value


class ExportSection(Section):
    #: Hub-ready output folder
    out: str = "checkpoints/tiny-export"
    #: org/name on the Hub; None: local folder only
    push_to_hub: Optional[str] = Field(default=None, pattern=r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
    private: bool = True
    #: branch to push to (created when missing)
    revision: str = "main"
    commit_message: str = "Upload drafter aligned with align"
    #: eval.json whose numbers go into the model card; None: none
    eval: Optional[str] = None
    #: licence id in the model card's metadata, one of the Hub's (HUB_LICENSES); None: the base model's (the
    #: `license` of its README.md front matter, local or in the Hub cache), or `unknown`, said so in the card, when
    #: the base states none
    license: Optional[str] = None
    #: with license `other`: the licence's name (a short slug, e.g. `llama3`), as the Hub asks
    license_name: Optional[str] = None
    #: with license `other`: a link to the licence's text (a URL, or a file in the exported folder such as LICENSE)
    license_link: Optional[str] = None
    #: align: the drafter as align (and transformers) load it; speculators: a DFlash drafter in the speculators
    #: format that `vllm serve --speculative-config` loads (config.json with speculators_config, vLLM's weight names)
    format: Literal["align", "speculators"] = "align"
    #: the verifier's Hub id (org/name), for the card's snippets and the speculators config when verifier.path is a
    #: local folder (whose path the folder never names); None: the verifier's own id, else a placeholder
    verifier_hub_id: Optional[str] = Field(default=None, pattern=r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
    #: format speculators: the draft tokens per step that `vllm serve <the folder>` serves and the card's commands
    #: pass (the speculators config's `speculative_tokens`), at most the drafter's block_size − 1; None: all a block
    #: drafts. Fewer verify fewer tokens per request, which is what keeps a drafter from slowing a server whose
    #: batches are full (`align serve-check ... decode.gamma=<k>` measures a setting at several concurrencies)
    num_speculative_tokens: Optional[int] = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> "ExportSection":
        if self.license is not None and self.license not in HUB_LICENSES:
            close = difflib.get_close_matches(self.license, HUB_LICENSES, n=3)
            raise ValueError(f"license {self.license!r} is not a Hub licence id"
                             + (f" (did you mean {', '.join(close)}?)" if close else "")
                             + "; see https://huggingface.co/docs/hub/repositories-licenses, or use `other` with "
                             "license_name and license_link")
        if self.license == "other" and not (self.license_name and self.license_link):
            raise ValueError("license other needs license_name and license_link (the Hub shows them in its place)")
        if self.num_speculative_tokens is not None and self.format != "speculators":
            raise ValueError("num_speculative_tokens is what vLLM serves from a speculators folder; set "
                             "format=speculators, or leave it unset")
        return self


class ServeCheckSection(Section):
    """`align serve-check`: the verifier served by vLLM without and with a DFlash drafter, beside align's runtime with
    the same drafter, on the eval prompts (eval.prompts, eval.split, eval.num_prompts), greedily, decode.max_new_tokens
    new tokens, decode.gamma draft tokens per step in both engines."""

    #: the drafter to serve: a speculators-format DFlash folder (`align export ... export.format=speculators`), or an
    #: align DFlash checkpoint (step_<N>), exported to a temporary folder first
    drafter: str = "checkpoints/tiny-dflash-export"
    #: output folder: serve_check.json and report.md
    out: str = "checkpoints/tiny-serve-check"
    #: the largest relative gap between vLLM's mean acceptance length and align's τ that passes (the issue: a larger
    #: one is a bug in one of the two engines)
    max_acceptance_gap: float = Field(default=0.10, gt=0.0)
    #: memory vLLM reserves for its KV cache on a CPU, in GiB (on a GPU it sizes the cache itself); unset: the same as
    #: trajectories.vllm_cpu_kv_cache_gib
    vllm_cpu_kv_cache_gib: Optional[float] = Field(default=None, gt=0.0)
    #: requests in flight at a time, each level measured in vLLM without and with the drafter (speculative decoding's
    #: gain shrinks as requests share a batch); the output and acceptance check runs at 1, which is always measured
    concurrency: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1], min_length=1)
    #: also serve with vLLM's own n-gram speculator (prompt lookup: decode.gamma tokens after the longest match of 1
    #: to 4 tokens), the drafter-free baseline vLLM users reach for first; one more engine to start
    ngram: bool = False


# --------------------------------------------------------------------------------------------------------------------
# the recipe
# --------------------------------------------------------------------------------------------------------------------
class MemorySection(Section):
    """`align memory`: one drafter layer measured at the recipe's width, extrapolated to its peak per GPU."""
    #: ranks the run is launched on (DeepSpeed's world size: what ZeRO shards over)
    world_size: int = Field(default=8, ge=1)
    #: prompt tokens a trajectory is taken to have (with trajectories.max_new_tokens and train.max_sequence_length:
    #: the sequence length measured)
    prompt_tokens: int = Field(default=512, ge=1)
    #: write the measured figures as JSON here; None: print the table only
    out: Optional[str] = Field(default=None, min_length=1)
    #: where the one layer is measured: cpu (the torch profiler's allocation trace) or cuda (the GPU's
    #: torch.cuda.max_memory_allocated, to check the CPU figures against a real GPU)
    device: Literal["cpu", "cuda"] = "cpu"


# Every recipe key naming a file or folder, where a leading ~ is the user's home, by one rule, at validation (so in
# recipes, overrides and align.load alike): the shell leaves ~ alone in `eval.out=~/x` (not a variable assignment) and
# YAML never expands it, and a `~` folder was made in the working directory. `*`: every item of a list or value of a
# mapping. tests/test_home_paths.py holds every other string key of the schema to its not being a path.
PATH_KEYS: tuple[str, ...] = (
    "verifier.path", "drafter.path", "ar_drafter.path", "data.dir", "data.train_prompts", "data.train_prompts.*.path",
    "trajectories.out", "states.out", "train.out", "train.deepspeed_config", "gkd.out", "decode.cps_proxy_corpus",
    "decode.suffix_corpus", "calibrate.out", "calibrate.graph", "calibrate.prompts", "eval.prompts", "eval.out",
    "eval.compare_drafters.*", "export.out", "export.eval", "serve_check.drafter", "serve_check.out",
    "convert.source", "convert.out", "prompts.out", "sharegpt.file", "sharegpt.out", "sharegpt.decontaminate.*",
    "derive.out", "bootstrap.out", "memory.out",
)


def expand_home(tree: Any, keys: tuple[str, ...] = PATH_KEYS) -> Any:
    """A copy of a recipe tree (nested dicts, as YAML and overrides give it) with ~ expanded in the values at `keys`."""
    import os

    def expand(node: Any, parts: list[str]) -> Any:
        if not parts:
            return os.path.expanduser(node) if isinstance(node, str) and node.startswith("~") else node
        head, rest = parts[0], parts[1:]
        if head == "*" and isinstance(node, list):
            return [expand(item, rest) for item in node]
        if head == "*" and isinstance(node, dict):
            return {k: expand(v, rest) for k, v in node.items()}
        if isinstance(node, dict) and head in node:
            return {**node, head: expand(node[head], rest)}
        return node

    for key in keys:
        tree = expand(tree, key.split("."))
    return tree


class Recipe(Section):
    @model_validator(mode="before")
    @classmethod
    def _expand_home(cls, data: Any) -> Any:
        return expand_home(data) if isinstance(data, dict) else data

    #: free text shown in manifests and model cards
    name: str = "recipe"
    verifier: VerifierSection = VerifierSection()
    drafter: DrafterSection = DrafterSection()
    #: set: `align train` builds a new DFlash drafter on the verifier instead of loading drafter.path
    dflash: Optional[DFlashSection] = None
    ar_drafter: ArDrafterSection = ArDrafterSection()
    data: DataSection = DataSection()
    trajectories: TrajectoriesSection = TrajectoriesSection()
    states: StatesSection = StatesSection()
    train: TrainSection = TrainSection()
    gkd: GkdSection = GkdSection()
    decode: DecodeSection = DecodeSection()
    calibrate: CalibrateSection = CalibrateSection()
    eval: EvalSection = EvalSection()
    export: ExportSection = ExportSection()
    serve_check: ServeCheckSection = ServeCheckSection()
    convert: ConvertSection = ConvertSection()
    prompts: PromptsSection = PromptsSection()
    sharegpt: ShareGPTSection = ShareGPTSection()
    derive: DeriveSection = DeriveSection()
    bootstrap: BootstrapSection = BootstrapSection()
    memory: MemorySection = MemorySection()

    def to_dict(self) -> dict[str, Any]:
        """The fully resolved recipe (defaults filled in), JSON-serialisable, for manifests."""
        return self.model_dump(mode="json")


SECTIONS: tuple[str, ...] = tuple(name for name in Recipe.model_fields if name != "name")


def first_line(error: BaseException) -> str:
    text = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__
