"""The checkpoint formats: `step_<N>` folders of merged weights (or a LoRA adapter with a checked pointer to its base
drafter), DeepSpeed state tags with `latest`, and how a record names a model's weights. Every write goes through
align/disk.py (atomic, checksummed).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

from align.config import Recipe, RecipeError
from align.drafters.kind import TrainedDrafter
from align.disk import (CHECKSUMS, STEP_FOLDER, HashingWriter, atomic_folder, discard_folder,
                        naming_path, record_checksums, unchanged_file_sha256, verify_checksums, write_hashed,
                        write_text_atomic)


# --------------------------------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------------------------------
def step_folders(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, folder) of every complete `step_<N>` checkpoint under run_dir, in step order."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := STEP_FOLDER.match(p.name))]
    return sorted(found)


def latest_step(run_dir: str | os.PathLike) -> Optional[Path]:
    """The highest `step_<N>` checkpoint folder under run_dir, or None."""
    folders = step_folders(run_dir)
    return folders[-1][1] if folders else None


def merged_model(module: Any, state: dict[str, Any]) -> Any:
    """A fresh copy of the drafter `module` (a plain model or a peft model) holding `state`, with any LoRA merged into
    the base weights: what users load with transformers alone. It keeps the dtype of `state` (the run's)."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    # The drafter's own class, not an Auto lookup: Dream/DiffuCoder-style remote-code models register AutoModel only,
    # and AutoModelForCausalLM.from_config cannot build them. Built on the meta device and given `state`'s tensors
    # (assign): a randomly initialised copy on the CPU first took rank 0 about a second per 28M parameters (15 minutes
    # for a 26B drafter, the other ranks waiting) and a second copy of the model's memory.
    import torch  # here: align.checkpoint is read by torch-free checks

    with torch.device("meta"):
        model = type(base)._from_config(base.config)
    if hasattr(module, "peft_config"):
        from peft import get_peft_model

        model = get_peft_model(model, module.peft_config["default"])
        model.load_state_dict(state, assign=True)
        model = model.merge_and_unload()
    else:
        model.load_state_dict(state, assign=True)
    return model.to(next(v.dtype for v in state.values() if v.is_floating_point()))


def save_merged(model: Any, tokenizer: Any, final: Path, files: dict[str, str], kind: str = "train") -> None:
    """Write `model` (merged, in its own dtype) and `tokenizer` as an HF folder at `final`, with extra text `files`
    (name -> content, e.g. meta.json), atomically, as `kind`'s output (a training checkpoint unless said), with its
    files' checksums (sha256.json) for every later reader."""
    _tied_keys_as_mapping(model)
    with atomic_folder(final, kind) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for name, text in files.items():
            (tmp / name).write_text(text)
        record_checksums(tmp)


# The shard size of a streamed save, and so what rank 0 holds at once (with one module's gathered parameters):
# transformers' own default (50 GB) would hold a 26B bf16 drafter whole; 5 GB is the Hub's usual shard.
STREAM_SHARD_BYTES = 5 * 1024**3


def _full_shape_state(model: Any) -> dict[str, Any]:
    """The model's state dict as meta tensors of the whole shapes: a ZeRO-3 parameter's own tensor is an empty
    placeholder between forwards, its shape is `ds_shape`."""
    import torch

    return {key: torch.empty(getattr(t, "ds_shape", t.shape), dtype=t.dtype, device="meta")
            for key, t in model.state_dict(keep_vars=True).items()}


def streamed_save_plan(model: Any, shard_bytes: int = STREAM_SHARD_BYTES) -> Optional[Any]:
    """save_pretrained's shard plan for `model` (huggingface_hub's StateDictSplit: which key goes in which file),
    built from the shapes alone, or None where save_pretrained would rename weights on the way out (transformers'
    weight conversions: the names a streamed save writes would not be the ones from_pretrained reads)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    _tied_keys_as_mapping(model)
    state = _full_shape_state(model)
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    # As save_pretrained: a tied weight is written once, under the name from_pretrained expects.
    state = remove_tied_weights_from_state_dict(state, model)
    if set(revert_weight_conversion(model, dict(state))) != set(state):
        return None
    # In the modules' order (save_pretrained may sort them): a shard is then complete as soon as its modules are
    # gathered, and rank 0 holds no weight of a later shard while it waits.
    return split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                              max_shard_size=shard_bytes)


def save_streamed(model: Any, plan: Any, tokenizer: Any, final: Path, files: dict[str, str], writer: bool,
                  kind: str = "train") -> int:
    """What save_merged writes, for a model whose parameters ZeRO-3 partitions over the ranks: every rank calls it
    (each module's parameters are gathered in turn, a collective), and the `writer` rank (rank 0) writes each
    safetensors shard of `plan` (streamed_save_plan) as soon as its last weight arrives, then frees it. Rank 0 holds
    at most a shard and a module: DeepSpeed's consolidated state dict would hold the whole drafter in its host memory
    (52 GB for a 26B bf16 drafter). The folder holds what save_pretrained writes at that shard size: the same files,
    index, weights and configs (tested against it), the shards filled in the modules' order, each hashed as it is
    written. Returns the most weight bytes rank 0 held at once (0 on the other ranks; a shard's serialized bytes,
    held while it is written, come on top)."""
    import contextlib

    import deepspeed
    from safetensors.torch import save
    from transformers.dynamic_module_utils import custom_object_save

    owner = plan.tensor_to_filename
    missing = {name: set(keys) for name, keys in plan.filename_to_tensors.items()}
    # Every floating weight in the run's dtype, as save_merged writes it: ZeRO-3 casts the parameters only, and a
    # persistent buffer (Gemma 4's per-layer `layer_scalar`) would stay in the dtype it was loaded in.
    dtype = model.dtype
    pending: dict[str, Any] = {}
    written: dict[str, str] = {}  # shard -> sha256, taken as it was written
    held = most_held = 0
    with atomic_folder(final, kind) if writer else contextlib.nullcontext() as tmp:
        for prefix, module in model.named_modules():
            params = dict(module.named_parameters(recurse=False))
            with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
                if not writer:
                    continue
                buffers = {n: b for n, b in module.named_buffers(recurse=False)
                           if n not in module._non_persistent_buffers_set}
                for name, tensor in {**params, **buffers}.items():
                    key = f"{prefix}.{name}" if prefix else name
                    if key not in owner:  # a tied weight's second name, or a key save_pretrained ignores
                        continue
                    pending[key] = tensor.detach().to("cpu", dtype if tensor.is_floating_point() else tensor.dtype,
                                                      copy=True).contiguous()
                    held += pending[key].nbytes
                    most_held = max(most_held, held)
                    shard = owner[key]
                    missing[shard].discard(key)
                    if not missing[shard]:
                        weights = {k: pending.pop(k) for k in plan.filename_to_tensors[shard]}
                        # Serialized in memory (the shard's bytes once more, briefly) to be hashed as written.
                        written[shard] = write_hashed(tmp / shard, save(weights, metadata={"format": "pt"}))
                        held -= sum(t.nbytes for t in weights.values())
        if not writer:
            return 0
        unwritten = sorted(k for keys in missing.values() for k in keys)
        if unwritten:  # a state dict key that no module names (a hook renames it): nothing is published
            raise RuntimeError(f"the streamed save found no parameter for {unwritten[:3]} in the model's modules")
        if plan.is_sharded:
            total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_parameters": total, **plan.metadata}, "weight_map": plan.tensor_to_filename},
                indent=2, sort_keys=True) + "\n")
        # The rest of save_pretrained (transformers 5): the config with the weights' dtype and the class, the
        # generation config, remote code.
        model.config.dtype = str(dtype).split(".")[1]
        model.config.architectures = [type(model).__name__]
        if model.is_remote_code():
            custom_object_save(model, tmp, config=model.config)
        model.config.save_pretrained(tmp)
        if model.can_generate():
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for name, text in files.items():
            (tmp / name).write_text(text)
        record_checksums(tmp, known=written)
    return most_held


# A LoRA run's step_<N>/ holds its adapter (peft's files), the base drafter's config and tokenizer, and a pointer to
# the base drafter (BASE_RECORD): a save writes megabytes where the merged model would rewrite every frozen weight.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_RECORD = "base_drafter.json"


def is_adapter_folder(folder: str | os.PathLike) -> bool:
    """Whether `folder` is a LoRA checkpoint align train wrote (an adapter and the pointer to its base drafter)."""
    return (Path(folder) / ADAPTER_CONFIG).is_file() and (Path(folder) / BASE_RECORD).is_file()


def save_adapter(module: Any, state: dict[str, Any], tokenizer: Any, base_path: str, final: Path,
                 files: dict[str, str], kind: str = "train") -> None:
    """Write the LoRA adapter of the peft model `module`, read from `state` (its full state dict, in the run's dtype:
    under ZeRO-3 the consolidated one, as the module's own parameters are partitioned), as peft's adapter_config.json
    + adapter_model.safetensors at `final`, atomically, with the base drafter's config (and remote code), the
    tokenizer, extra text `files`, BASE_RECORD (the base drafter `base_path`: its resolved path and weights' sha256,
    so that a changed base is refused when read) and the files' checksums."""
    import copy

    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    adapter = {k: v.detach().cpu().contiguous() for k, v in
               get_peft_model_state_dict(module, state_dict=state, save_embedding_layers=False).items()}
    config = copy.deepcopy(module.peft_config["default"])
    identity = drafter_identity(base_path)
    config.base_model_name_or_path, config.inference_mode = identity["resolved"], True
    base = module.get_base_model()
    with atomic_folder(final, kind) as tmp:
        config.save_pretrained(tmp)
        save_file(adapter, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        base.config.save_pretrained(tmp)
        local = Path(identity["resolved"])
        for code in (sorted(local.glob("*.py")) if local.is_dir() else []):  # remote code the config names
            shutil.copy2(code, tmp / code.name)
        tokenizer.save_pretrained(tmp)
        (tmp / BASE_RECORD).write_text(json.dumps(identity, indent=2))
        for name, text in files.items():
            (tmp / name).write_text(text)
        record_checksums(tmp)


def adapter_base(folder: str | os.PathLike) -> str:
    """The base drafter of the LoRA checkpoint `folder`, checked: RecipeError (one line) when it is gone or its
    weights are not the ones the adapter was trained on."""
    record = json.loads((Path(folder) / BASE_RECORD).read_text())
    base = record["resolved"]
    now = weights_sha256_of(base)
    if now is None and not Path(base).is_dir():
        raise RecipeError(f"drafter.path: {folder} is a LoRA adapter on {base}, which is not on this machine; put the "
                          "base drafter back there, or export the merged model where it is")
    if record.get("weights_sha256") and now != record["weights_sha256"]:
        raise RecipeError(f"drafter.path: {folder} is a LoRA adapter on {base}, whose weights have changed since it "
                          f"was trained (sha256 {record['weights_sha256'][:12]}…, now {str(now)[:12]}…); restore "
                          "that base drafter")
    return base


def weights_sha256_of(path: str) -> Optional[str]:
    """weights_sha256 of a local folder or a Hub id's cached snapshot (each file hashed once per process while its
    size and time stay the same: a 7B base is not hashed again at every load)."""
    from align.hub import hub_snapshot, is_hub_id

    folder = Path(path) if Path(path).is_dir() else hub_snapshot(path) if is_hub_id(path) else None
    return None if folder is None else weights_sha256(Path(folder))


def adapter_dtype(folder: str | os.PathLike) -> Any:
    """The dtype the adapter was saved in (the run's)."""
    from safetensors import safe_open

    with safe_open(str(Path(folder) / ADAPTER_WEIGHTS), framework="pt") as f:
        return next(f.get_slice(k).get_dtype() for k in f.keys())


def merge_adapter(base: Any, folder: str | os.PathLike) -> Any:
    """`base` (a loaded drafter) with the LoRA adapter of `folder` merged into its weights, as the merged checkpoint
    of older versions held them: the merge is computed in the adapter's dtype (the run's), then the weights go back
    to `base`'s dtype. Only parameters are cast: computed buffers (rotary inv_freq) keep their precision."""
    import torch
    from peft import PeftModel

    saved = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[adapter_dtype(folder)]
    dtype = next(base.parameters()).dtype
    device = next(base.parameters()).device
    for p in base.parameters():
        p.data = p.data.to(saved)
    model = PeftModel.from_pretrained(base, str(folder), autocast_adapter_dtype=False, torch_device=str(device))
    model = model.merge_and_unload()
    for p in model.parameters():
        p.data = p.data.to(dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def _tied_keys_as_mapping(model: Any) -> None:
    """Remote code written for transformers 4 (Dream, DiffuCoder: `_tied_weights_keys = ["lm_head.weight"]`) lists
    its tied weights, where transformers 5's save_pretrained reads a {tied: source} mapping and fails on a list.
    Untied models (the configs' `tie_word_embeddings: false`) tie nothing, so the mapping is empty; a tied one maps
    each listed key to the input embedding."""
    listed = [m for m in model.modules() if isinstance(getattr(m, "_tied_weights_keys", None), (list, tuple))]
    if not listed:
        return  # transformers 5 models, and models without input embeddings of their own (DFlash drafters)
    embedding = model.get_input_embeddings()
    source = next((f"{name}.weight" for name, module in model.named_modules() if module is embedding), None)
    tied = getattr(model.config, "tie_word_embeddings", False)
    for module in listed:
        module._tied_weights_keys = {key: source for key in module._tied_weights_keys} if tied and source else {}


# --------------------------------------------------------------------------------------------------------------------
# which model a record names (eval.json's drafters, found again by align export)
# --------------------------------------------------------------------------------------------------------------------
def weights_sha256(folder: Path) -> Optional[str]:
    """The sha256 of a model folder's weights: of its one weights file (what `sha256sum model.safetensors` prints),
    or of the `sha256sum` lines of its shards, sorted by name; None when it holds none."""
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        return None
    if len(files) == 1:
        return unchanged_file_sha256(files[0])
    lines = "".join(f"{unchanged_file_sha256(f)}  {f.name}\n" for f in files)
    return hashlib.sha256(lines.encode()).hexdigest()


def drafter_identity(path: str) -> dict[str, Any]:
    """How eval.json names a drafter so that it is found again from any folder: `path` as given, `resolved` (the
    absolute folder, or the Hub id) and `weights_sha256` (of the local folder or the Hub cache's snapshot; None when
    neither is on this machine). A relative path alone would be read against whatever folder export runs in."""
    from align.hub import hub_snapshot, is_hub_id

    local = Path(path).expanduser()
    folder = local if local.is_dir() else hub_snapshot(path) if is_hub_id(path) else None
    return {"path": path, "resolved": str(local.resolve()) if local.is_dir() else path,
            "weights_sha256": weights_sha256(folder) if folder is not None else None}
# DeepSpeed state (ds_state/): a folder per tag, and `latest` naming the one to resume
# --------------------------------------------------------------------------------------------------------------------
def commit_state(state_dir: str | os.PathLike, tag: str, known: Optional[dict[str, str]] = None) -> None:
    """Make `state_dir`/`tag`, which DeepSpeed has just written whole (every rank's files, after its barrier), the
    one to resume: its checksums, then `latest` in one rename. DeepSpeed writes neither atomically (a crash could
    leave `latest` empty, or naming a half-written tag); here a tag with a sha256.json is complete, and `latest`
    only ever names such a tag. `known`: the digests the ranks took as they wrote (HashingCheckpointEngine), by name
    in the tag; only files without one are read back. Call on rank 0; on several nodes without a shared folder it
    sees its own files."""
    state_dir = Path(state_dir)
    record_checksums(state_dir / tag, known=known)
    write_text_atomic(state_dir / "latest", tag)


class HashingCheckpointEngine:
    """DeepSpeed's checkpoint engine with each file's sha256 taken as it is written (torch.save into a
    disk.HashingWriter), on the rank that writes it: the commit's record then reads nothing back (rank 0 used to
    hash every rank's optimizer shards, ~410 GB for a 26B drafter, while the others waited). Everything else, and
    any other engine a user's DeepSpeed config chooses (whose files rank 0 then hashes), is DeepSpeed's own."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.digests: dict[str, str] = {}  # absolute path -> sha256, of the files written since the last take()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def save(self, state_dict: Any, path: str) -> None:
        import torch
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        if type(self.inner) is not TorchCheckpointEngine:
            return self.inner.save(state_dict, path)
        with HashingWriter(Path(path)) as f:
            torch.save(state_dict, f, _use_new_zipfile_serialization=self.inner.zipfile_serialization)
        self.digests[str(Path(path).resolve())] = f.hexdigest()

    def take(self) -> dict[str, str]:
        digests, self.digests = self.digests, {}
        return digests


def hashing_engine(engine: Any) -> HashingCheckpointEngine:
    """The DeepSpeed `engine`'s checkpoint engine, made a HashingCheckpointEngine (once)."""
    if not isinstance(engine.checkpoint_engine, HashingCheckpointEngine):
        engine.checkpoint_engine = HashingCheckpointEngine(engine.checkpoint_engine)
    return engine.checkpoint_engine


def written_digests(hashing: HashingCheckpointEngine, folder: Path, world: int) -> dict[str, str]:
    """Every rank's digests of the files it wrote into `folder` since the last take (a collective: every rank calls
    it), by name relative to `folder`, on every rank."""
    mine = {str(Path(path).relative_to(folder.resolve())): digest for path, digest in hashing.take().items()
            if Path(path).is_relative_to(folder.resolve())}
    if world == 1:
        return mine
    import torch.distributed as dist

    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    return {name: digest for each in gathered for name, digest in each.items()}


def state_to_resume(state_dir: str | os.PathLike, who: str = "align train", warn: bool = True,
                    verify: bool = True) -> Optional[str]:
    """The DeepSpeed tag under `state_dir` to resume from, checked against its checksums; None when there is none
    (a new run, or one killed before its first state was complete).

    An empty or dangling `latest` (a crash in an older version's non-atomic write, or a hand edit) falls back, with
    a warning, to the newest tag whose checksums verify: resuming is exact from any complete state, so the fallback
    costs only the steps after it, recomputed to the same values. A tag whose files differ from their checksums was
    damaged after it was complete (the disk, a copy): that is refused, naming the file, rather than resumed around.
    A tag from before checksums were recorded is loaded unchecked. `warn`: say the fallback (once per run: the
    preflight asks quietly, the resume says it). `verify`: hash the files (False where another process of this
    machine or the launcher has: disk.hashes_inputs; the tag chosen is the same, read from the records alone)."""
    state_dir = Path(state_dir)
    latest = state_dir / "latest"
    tags = sorted((int(m.group(1)), p.name) for p in state_dir.iterdir()
                  if p.is_dir() and (m := STEP_FOLDER.match(p.name))) if state_dir.is_dir() else []
    complete = [name for _, name in reversed(tags) if (state_dir / name / CHECKSUMS).is_file()]  # newest first
    named = latest.read_text(errors="replace").strip() if latest.is_file() else None
    if named and (named in complete or (not complete and (state_dir / named).is_dir())):
        if verify:
            verify_checksums(state_dir / named, "train.out")  # (a tag from before checksums: nothing to verify)
        return named
    if named is None and not complete:
        return None  # nothing was ever committed: a new run, or one killed in its first save
    why = ("is missing" if named is None else "is empty" if not named else
           f"names {named}, which is not a complete state there")
    if not complete:
        raise RecipeError(f"train.out: {latest} {why}, and no complete state is left to resume from; delete "
                          f"{state_dir} to start the run afresh")
    if verify:
        verify_checksums(state_dir / complete[0], "train.out")
    if warn:
        print(f"{who}: warning: {latest} {why}; resuming from {state_dir / complete[0]}, the newest state whose "
              "checksums verify", file=sys.stderr)
    return complete[0]


# Saving a training run's checkpoint under DeepSpeed (align/stages/train.py): the step folder in the run's dtype,
# LoRA and ZeRO-3 each saved without gathering what they need not, then the DeepSpeed state for exact resume.
def is_lora(module: Any) -> bool:
    """Whether the drafter trains LoRA adapters (a peft model), its base frozen."""
    return hasattr(module, "peft_config")


@contextlib.contextmanager
def gathering_for_a_save(engine: Any) -> Iterator[None]:
    """Around a save's gathers of ZeRO-3 parameters, what DeepSpeed's own consolidation does: every parameter
    partitioned first (ZeRO-3 keeps the small ones whole), and those whole again after."""
    engine.optimizer.checkpoint_event_prologue()
    yield
    engine.optimizer.checkpoint_event_epilogue()


def save_checkpoint(trainer: Any, recipe: Recipe, out: Path, step: int, meta: dict[str, Any]) -> None:
    """`out/step_<N>/` (the drafter, or a LoRA run's adapter and its base's pointer, in the run's dtype, written
    atomically by rank 0), then the DeepSpeed state for exact resume. Only called with finite weights.
    trainer: align.stages.train.Trainer (its engine, rank, device and tokenizer; a building block names no stage)."""
    module = trainer.engine.module
    files = {"meta.json": json.dumps({"step": step, **meta}, indent=2)}
    # A LoRA run's step folder is its adapter, with a checked pointer to the base drafter (a DFlash drafter's LoRA is
    # merged): readers merge it, export writes it merged.
    adapter_only = TrainedDrafter.of(recipe).saves_adapter_only(is_lora(module))
    plan = streamed_save_plan(module) if recipe.train.zero_stage == 3 and not is_lora(module) else None
    if plan is not None:
        # Each shard written as its modules are gathered: rank 0 never holds the whole drafter.
        with gathering_for_a_save(trainer.engine):
            save_streamed(module, plan, trainer.tokenizer, out / f"step_{step}", files, writer=trainer.rank == 0)
    elif recipe.train.zero_stage == 3 and adapter_only:
        # The adapter alone, a parameter at a time, copied to rank 0's host: DeepSpeed's consolidation would gather
        # the frozen base as well (the whole model on rank 0) for a ~160 MB adapter.
        import deepspeed

        state = {}
        with gathering_for_a_save(trainer.engine):
            for name, param in module.named_parameters():
                if param.requires_grad:
                    with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                        if trainer.rank == 0:
                            state[name] = param.detach().to("cpu", copy=True)
        state = state if trainer.rank == 0 else None
    elif recipe.train.zero_stage == 3:
        # Each rank holds a shard. Every rank enters DeepSpeed's consolidation, which gathers one module's parameters
        # at a time and copies them to rank 0's host memory only: no rank holds the whole model on its device (a
        # gather of every parameter at once would add the full 16-bit model to each GPU).
        state = trainer.engine._zero3_consolidated_16bit_state_dict()
        if state is not None and trainer.device.type == "cpu":
            state = {k: v.clone() for k, v in state.items()}  # on a CPU `.cpu()` copies nothing: own the weights
    elif adapter_only:
        # save_adapter copies the adapter's tensors alone to the CPU: no host copy of the frozen base (15 GB for a
        # 7B drafter) for the ~160 MB it writes.
        state = module.state_dict() if trainer.rank == 0 else None
    else:
        # A copy of its own: merging LoRA into the base weights (merged_model) changes them in place.
        state = ({k: v.detach().cpu().clone() for k, v in module.state_dict().items()} if trainer.rank == 0
                 else None)
    if trainer.rank == 0 and plan is None:
        if adapter_only:
            save_adapter(module, state, trainer.tokenizer, recipe.drafter.path, out / f"step_{step}", files)
        else:
            save_merged(merged_model(module, state), trainer.tokenizer, out / f"step_{step}", files)
    # `latest` is written by commit_state, after the tag's checksums, never by DeepSpeed (whose write is not atomic).
    hashing = hashing_engine(trainer.engine)
    with naming_path(out / "ds_state" / f"step_{step}"):  # torch's writer names no file when the disk is full
        # A LoRA run's state leaves out the frozen base (15 GB a save for a 7B drafter): a resume loads the base from
        # drafter.path, whose weights check_resumed_weights holds to the ones the run started from.
        trainer.engine.save_checkpoint(str(out / "ds_state"), tag=f"step_{step}", client_state={"step": step},
                                       save_latest=False, exclude_frozen_parameters=is_lora(module))
    # DeepSpeed's save ends with a barrier: every rank's files are written, each hashed by its writer.
    known = written_digests(hashing, out / "ds_state" / f"step_{step}", trainer.world)
    if trainer.rank == 0:
        commit_state(out / "ds_state", f"step_{step}", known)
        if recipe.train.keep_last is not None:
            prune_checkpoints(out, recipe.train.keep_last)


def prune_checkpoints(out: Path, keep_last: int) -> list[Path]:
    """Delete all but the `keep_last` newest step_<N> folders and ds_state tags (never the tag `latest` names, nor
    its step folder); returns what was deleted. Called on rank 0 after a save is committed. Each is first renamed out
    of the step_<N> pattern, so that an interrupted delete leaves no half folder that a resume or an export would
    take for a checkpoint."""
    state_dir = out / "ds_state"
    latest = (state_dir / "latest").read_text().strip() if (state_dir / "latest").is_file() else None
    deleted = []
    for folder in (out, state_dir):
        steps = step_folders(folder)
        for _, path in steps[: max(0, len(steps) - keep_last)]:
            if path.name == latest:
                continue
            discard_folder(path)
            deleted.append(path)
    return deleted
