"""The DFlash drafter kind (align/drafters/dflash.py): lossless in the runtime, trainable with every window loss,
exported in the speculators format that vLLM's qwen3_dflash loads."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from align.decoding.ar import ar_generate
from align.decoding.generation import Sampling
from align.decoding.specdiff import specdiff_generate
from align.drafters.dflash import DFlashDrafter, DraftVocab, config_for_verifier, set_draft_vocab
from align.drafters.spec import drafter_spec_from_config
from align.losses import WINDOW_LOSSES

VOCAB, MASK = 32, 31


def tiny_verifier(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def tiny_dflash(verifier: LlamaForCausalLM, seed: int = 1) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter(config_for_verifier(verifier.config, MASK, num_layers=2, intermediate_size=48)).eval()


KEEP = (0, 2, 3, 5, 8, 13, 21, 30)  # a pruned draft vocabulary: 8 of the verifier's 32 tokens


def pruned_dflash(verifier: LlamaForCausalLM, seed: int = 1) -> DFlashDrafter:
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config_for_verifier(verifier.config, MASK, num_layers=2, intermediate_size=48,
                                                draft_vocab_size=len(KEEP))).eval()
    set_draft_vocab(drafter, verifier.get_output_embeddings().weight, torch.tensor(KEEP))
    return drafter


def test_spec_says_dflash():
    verifier = tiny_verifier()
    spec = drafter_spec_from_config(tiny_dflash(verifier).config)
    assert (spec.kind, spec.mask_token_id, spec.logits_shift) == ("dflash", MASK, 0)


@pytest.mark.slow
def test_greedy_specdiff_with_a_dflash_drafter_is_token_identical_to_ar_greedy():
    verifier = tiny_verifier()
    drafter = tiny_dflash(verifier)
    spec = drafter_spec_from_config(drafter.config)
    for seed in range(3):
        prompt = torch.randint(0, MASK, (1, 5), generator=torch.Generator().manual_seed(seed))
        expected = ar_generate(verifier, prompt, 24, Sampling())[0]
        for gamma in (1, 3, 6):
            tokens, stats = specdiff_generate(verifier, drafter, spec, prompt, gamma, 24)
            assert tokens == expected
            assert stats.verifier_forwards < 24 or gamma == 1


def sliding_causal(drafter: DFlashDrafter, window: int = 5) -> DFlashDrafter:
    """The layers as speculators' trainer makes them by default (and vLLM serves them): the first sliding over
    `window` positions, every layer block-causal."""
    drafter.config.layer_types = ["sliding_attention"] + ["full_attention"] * (drafter.config.num_hidden_layers - 1)
    drafter.config.sliding_window, drafter.config.causal = window, True
    return drafter


@pytest.mark.parametrize("pruned,attention", [(False, "full"), (True, "full"), (False, "sliding_causal")])
def test_training_windows_see_what_the_runtime_shows_the_drafter(pruned, attention):
    """A training window at start s must give the logits the runtime gets when it drafts after position s-1 with the
    context grown token by token: same context (positions before the anchor), same anchor, same positions. A pruned
    drafter's windows are over its draft vocabulary, the verifier's logits there its columns for those tokens; a
    sliding, block-causal drafter's windows see what its runtime blocks see."""
    from align.drafters.dflash import DFlashContext, dflash_block_logits, dflash_window_logits
    from align.drafters.base import aux_hidden

    verifier = tiny_verifier()
    drafter = pruned_dflash(verifier) if pruned else tiny_dflash(verifier)
    if attention == "sliding_causal":
        sliding_causal(drafter)
    ids = torch.randint(0, MASK, (1, 14), generator=torch.Generator().manual_seed(0))
    hidden = aux_hidden(verifier(input_ids=ids, output_hidden_states=True).hidden_states,
                        drafter.config.aux_hidden_state_layer_ids)
    starts = torch.tensor([[3, 8, 10]])
    windows, verifier_logits = dflash_window_logits(drafter, verifier, ids, starts, 4)
    expected_verifier = verifier(input_ids=ids).logits[0, 7]
    if pruned:
        assert windows.shape[-1] == verifier_logits.shape[-1] == len(KEEP)
        expected_verifier = expected_verifier[list(KEEP)]
        windows = DraftVocab.of(drafter).to_verifier(windows)
    torch.testing.assert_close(verifier_logits[0, 1, 0], expected_verifier)
    for w, start in enumerate(starts[0].tolist()):
        context = DFlashContext()
        for i in range(0, start - 1, 3):  # grown in uneven steps, as accepted tokens arrive
            context.extend(drafter, hidden[:, i: min(i + 3, start - 1)])
        expected = dflash_block_logits(drafter, verifier, ids[:, start - 1: start], 4, context)
        torch.testing.assert_close(windows[:, w], expected, rtol=1e-4, atol=1e-5)


def test_a_block_causal_sliding_layer_sees_the_earlier_slots_and_the_window_only():
    """`layer_mask`: with `causal` a block slot sees the context and the slots up to its own; a sliding layer sees
    the keys after its position - window (vLLM's count); a full, bidirectional layer's mask is the one given."""
    verifier = tiny_verifier()
    drafter = sliding_causal(tiny_dflash(verifier), window=4)
    positions = torch.tensor([[6, 7, 8]])  # anchor at 6 after a context of 6 positions (0..5)
    allowed = drafter.layer_mask(0, positions, 6, None)[0, 0] == 0  # (Q, C + Q)
    keys = list(range(6)) + [6, 7, 8]
    for q, position in enumerate(positions[0].tolist()):
        assert allowed[q].tolist() == [position - 4 < key <= position for key in keys]
    full = drafter.layer_mask(1, positions, 6, None)[0, 0] == 0  # causal, no window
    assert full.tolist() == [[key <= position for key in keys] for position in positions[0].tolist()]
    drafter.config.causal = False
    given = torch.zeros(1, 1, 3, 9)
    assert drafter.layer_mask(1, positions, 6, given) is given
    # and it reaches the logits: the same drafter drafts otherwise when its layers are full and bidirectional
    ids = torch.randint(0, MASK, (1, 12), generator=torch.Generator().manual_seed(0))
    from align.drafters.dflash import dflash_window_logits

    bidirectional, _ = dflash_window_logits(tiny_dflash(verifier), verifier, ids, torch.tensor([[9]]), 3)
    narrowed, _ = dflash_window_logits(sliding_causal(tiny_dflash(verifier), window=4), verifier, ids,
                                       torch.tensor([[9]]), 3)
    assert not torch.allclose(bidirectional, narrowed)


@pytest.mark.parametrize("attention", ["full", "sliding_causal"])
def test_the_speculators_config_carries_how_the_layers_attend_both_ways(tmp_path, attention):
    """An export of a drafter read from speculators' folder keeps its layer types, window and causality (vLLM reads
    them from the export as from the original), and align's own drafters export as before: full, non-causal."""
    import json
    import warnings

    from align.drafters.speculators_format import speculators_config, speculators_dflash_config

    drafter = tiny_dflash(tiny_verifier())
    if attention == "sliding_causal":  # every layer sliding, as speculators' trainer makes them by default
        sliding_causal(drafter, window=7).config.layer_types = ["sliding_attention"] * 2
    written = speculators_config(drafter.config, "verifier", ["LlamaForCausalLM"], torch.float32)
    layer = written["transformer_layer_config"]
    assert written["sliding_window_non_causal"] is (attention == "full")
    assert ("layer_types" in layer) is (attention == "sliding_causal")
    (tmp_path / "config.json").write_text(json.dumps(written))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a full layer served block-causal would warn: neither does
        read = speculators_dflash_config(str(tmp_path))
    assert (read.layer_types, read.sliding_window, read.causal) == \
        (drafter.config.layer_types, drafter.config.sliding_window, drafter.config.causal)


@pytest.mark.parametrize("pruned", [False, True])
def test_cached_states_give_the_windows_and_verifier_logits_of_the_verifier_s_forward(pruned):
    """train.cache_verifier_states: the drafter's windows from cached states are those of a step that runs the
    verifier; with the final states cached too, so are the verifier logits KD losses read; without them, none."""
    from align.drafters.dflash import dflash_window_logits, verifier_states

    verifier = tiny_verifier()
    drafter = pruned_dflash(verifier) if pruned else tiny_dflash(verifier)
    ids = torch.randint(0, MASK, (2, 14), generator=torch.Generator().manual_seed(0))
    starts = torch.tensor([[3, 8, 10], [2, 5, 11]])
    layer_ids = drafter.config.aux_hidden_state_layer_ids
    windows, verifier_logits = dflash_window_logits(drafter, verifier, ids, starts, 4)
    cached = dflash_window_logits(drafter, verifier, ids, starts, 4, verifier_states(verifier, ids, layer_ids, True))
    torch.testing.assert_close(cached[0], windows)
    torch.testing.assert_close(cached[1], verifier_logits)
    aux_only = dflash_window_logits(drafter, verifier, ids, starts, 4, verifier_states(verifier, ids, layer_ids))
    torch.testing.assert_close(aux_only[0], windows)
    assert aux_only[1] is None


def training_step_loss(drafter: DFlashDrafter, verifier: LlamaForCausalLM, loss: str, data_mode: str,
                       rows: list[dict]) -> torch.Tensor:
    """The training loop's losses on `rows` (γ 3, 2 windows a row), summed and back-propagated."""
    from types import SimpleNamespace

    from align.recipe_files import load_recipe
    from align.stages.train import compute_losses
    from align.windows import block_causal_windows

    spec = drafter_spec_from_config(drafter.config)
    recipe = load_recipe("recipes/tiny/dflash.yaml", [f"train.losses={{{loss}: 1.0}}", "train.gamma=3",
                                                      f"train.data_mode={data_mode}"])
    batch = block_causal_windows(rows, spec, 3, 2, 0, np.random.default_rng(0))
    # The loop's step holds the DeepSpeed engine; compute_losses reads only its module.
    trainer = SimpleNamespace(engine=SimpleNamespace(module=drafter), spec=spec, verifier=verifier, pad_id=0)
    total = sum(compute_losses(trainer, batch, rows, recipe, batch.num_windows,
                               int(batch.target_mask.sum())).values())
    total.backward()
    return total


@pytest.mark.slow
@pytest.mark.parametrize("data_mode", ["offline", "on_policy"])
@pytest.mark.parametrize("loss", sorted(WINDOW_LOSSES))
def test_a_training_step_with_every_loss_is_finite_and_trains_the_drafter_only(loss, data_mode):
    verifier = tiny_verifier()
    drafter = tiny_dflash(verifier).train()
    rows = [{"prompt_ids": [1, 2, 3, 4], "completion_ids": [5, 6, 7, 8, 9, 10, 11]},
            {"prompt_ids": [7, 3], "completion_ids": [12, 13, 14, 15]}]
    assert torch.isfinite(training_step_loss(drafter, verifier, loss, data_mode, rows))
    grads = {name: p.grad for name, p in drafter.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    for name in ("fc.weight", "layers.0.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight"):
        assert grads[name].abs().sum() > 0, name
    assert all(p.grad is None for p in verifier.parameters())


def test_a_pruned_draft_vocabulary_drafts_its_tokens_only_and_greedy_stays_identical_to_ar():
    from align.drafters.base import aux_hidden
    from align.drafters.dflash import DFlashContext, dflash_block_logits

    verifier = tiny_verifier()
    drafter = pruned_dflash(verifier)
    # speculators' maps: draft id i is verifier id i + d2t[i]; t2d marks the verifier ids kept
    assert (torch.arange(len(KEEP)) + drafter.d2t).tolist() == list(KEEP)
    assert drafter.t2d.nonzero().flatten().tolist() == list(KEEP)
    torch.testing.assert_close(drafter.lm_head.weight, verifier.lm_head.weight[list(KEEP)])
    assert drafter.get_output_embeddings() is None  # transformers must not tie or resize the pruned head
    ids = torch.randint(0, MASK, (1, 9), generator=torch.Generator().manual_seed(2))
    context = DFlashContext()
    states = verifier(input_ids=ids, output_hidden_states=True).hidden_states
    context.extend(drafter, aux_hidden(states, drafter.config.aux_hidden_state_layer_ids)[:, :-1])
    probs = dflash_block_logits(drafter, verifier, ids[:, -1:], 4, context).softmax(-1)  # (1, 4, 32)
    assert probs.shape == (1, 4, VOCAB)
    outside = [t for t in range(VOCAB) if t not in KEEP]
    assert probs[..., outside].max() == 0 and torch.isfinite(probs.log().clamp_min(-1e30)).all()
    torch.testing.assert_close(probs[..., list(KEEP)].sum(-1), torch.ones(1, 4))
    spec = drafter_spec_from_config(drafter.config)
    for seed in range(3):
        prompt = torch.randint(0, MASK, (1, 5), generator=torch.Generator().manual_seed(seed))
        expected = ar_generate(verifier, prompt, 24, Sampling())[0]
        tokens, _ = specdiff_generate(verifier, drafter, spec, prompt, 3, 24)
        assert tokens == expected


def test_the_draft_vocabulary_is_the_most_frequent_completion_tokens_and_ends_streaks_it_cannot_draft():
    from align.drafters.dflash import most_frequent_tokens

    completions, prompts = [[5, 5, 7], [7, 5, 9]], [[9, 9, 3]]
    # by completion count (5, 7, 9), then prompt count (3), then the lowest id (0); returned ascending
    assert most_frequent_tokens(completions, prompts, 4, 12).tolist() == [3, 5, 7, 9]
    assert most_frequent_tokens(completions, prompts, 5, 12).tolist() == [0, 3, 5, 7, 9]
    verifier = tiny_verifier()
    vocab = DraftVocab.of(pruned_dflash(verifier))
    targets, mask = vocab.training_targets(torch.tensor([[2, 30, 4, 5], [0, 8, 13, 21]]), torch.ones(2, 4, dtype=bool))
    assert mask.tolist() == [[True, True, False, False], [True] * 4]  # 4 is not kept: no streak reaches past it
    assert targets[0, :2].tolist() == [1, 7] and targets[1].tolist() == [0, 4, 5, 6]
    logits = torch.randn(3, VOCAB)
    assert torch.equal(vocab.to_verifier(vocab.columns(logits))[:, list(KEEP)], logits[:, list(KEEP)])


def test_the_draft_vocabulary_kept_on_the_drafter_follows_its_maps():
    """DraftVocab.of keeps the maps it computed on the drafter: a new vocabulary written in place, or weights loaded
    into it, must be read anew, never served from before."""
    verifier = tiny_verifier()
    drafter = pruned_dflash(verifier)
    first = DraftVocab.of(drafter)
    assert DraftVocab.of(drafter) is first  # nothing changed: the kept one
    other = torch.tensor(sorted(set(range(len(KEEP) + 3)) - {1, 2, 4})[:len(KEEP)])
    set_draft_vocab(drafter, verifier.get_output_embeddings().weight, other)
    assert DraftVocab.of(drafter).target_ids.tolist() == other.tolist()
    drafter.load_state_dict(pruned_dflash(verifier, seed=2).state_dict())
    assert DraftVocab.of(drafter).target_ids.tolist() == list(KEEP)


@pytest.mark.slow
@pytest.mark.parametrize("loss,data_mode", [("ce_streak", "offline"), ("fkl", "offline"), ("ce_streak", "on_policy")])
def test_a_pruned_drafter_trains_its_head_on_the_targets_it_can_draft(loss, data_mode):
    verifier = tiny_verifier()
    drafter = pruned_dflash(verifier).train()
    # every completion token kept but 7 and 12: their windows' streaks end there
    rows = [{"prompt_ids": [1, 2, 3, 4], "completion_ids": [5, 8, 7, 13, 21, 30, 0]},
            {"prompt_ids": [7, 3], "completion_ids": [12, 13, 2, 3]}]
    assert torch.isfinite(training_step_loss(drafter, verifier, loss, data_mode, rows))
    assert drafter.lm_head.weight.grad.abs().sum() > 0 and torch.isfinite(drafter.lm_head.weight.grad).all()
    assert all(p.grad is None for p in verifier.parameters())


def test_train_from_scratch_then_eval_reports_a_dflash_row(toy_trajectories, tmp_path):
    """`align train` builds a new DFlash drafter on the (toy) verifier and trains it under DeepSpeed; `align eval`
    runs it beside the standalone drafter, token-identical to AR greedy."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from conftest import TOY_TRAJECTORIES, checkout_env

    from align.cli import main as align

    root, traj = toy_trajectories
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "run"
    args = [f"verifier.path={root / 'ck' / 'verifier'}", f"trajectories.out={traj}", *TOY_TRAJECTORIES,
            f"data.dir={root / 'data'}", f"train.out={out}", "train.gamma=4", "train.windows_per_sequence=4",
            "train.max_steps=3", "train.micro_batch_size=2", "train.eval_every=3", "train.save_every=3",
            "train.final_eval_prompts=1", "train.losses={ce_streak: 1.0, fkl: 0.5}", "dflash.aux_layer_ids=[0]",
            "dflash.intermediate_size=48", "dflash.draft_vocab_size=128"]
    env = checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "align/train.py", "recipes/tiny/dflash.yaml", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    config = json.loads((out / "step_3" / "config.json").read_text())
    assert config["model_type"] == "align_dflash" and config["drafter_spec"]["kind"] == "dflash"
    # the pruned head and its maps are saved with the drafter (the maps from this run's trajectories)
    from safetensors.torch import load_file
    weights = load_file(str(out / "step_3" / "model.safetensors"))
    assert config["draft_vocab_size"] == 128 and weights["lm_head.weight"].shape[0] == 128
    assert int(weights["t2d"].sum()) == 128 and weights["d2t"].dtype == torch.int64
    assert "final_tau" in json.loads((out / "step_3" / "meta.json").read_text())

    assert align(["eval", "recipes/tiny/dflash.yaml", f"verifier.path={root / 'ck' / 'verifier'}",
                  f"drafter.path={root / 'ck' / 'drafter-base'}", f"data.dir={root / 'data'}",
                  f"eval.compare_drafters={{dflash: {out / 'step_3'}}}", f"eval.out={tmp_path / 'eval'}",
                  "eval.num_prompts=2", "eval.warmup=0", "decode.max_new_tokens=8", "decode.gamma=3"]) in (0, None)
    methods = json.loads((tmp_path / "eval" / "eval.json").read_text())["methods"]
    assert {"specdiff", "specdiff@dflash"} <= set(methods)
    assert methods["specdiff@dflash"]["exact_match"] == 1.0
    assert methods["specdiff@dflash"]["tau"] >= 1.0


@pytest.mark.slow
def test_train_starts_from_a_speculators_folder_and_keeps_its_vocabulary_maps(toy_trajectories, tmp_path):
    """`align train` with `drafter.path` a speculators DFlash folder (align's export here; speculators' own layout is
    read alike, tests/drafters/test_speculators_fidelity.py) and no `dflash` section trains those weights (issue 36):
    they move from the folder's, not from a random start, the pruned head keeps the folder's d2t/t2d maps (not the
    ones these trajectories would rank), and the step decodes AR's greedy tokens in align's eval."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from conftest import TOY_TRAJECTORIES, checkout_env
    from safetensors.torch import load_file

    from align.checkpoint import save_merged
    from align.cli import main as align
    from align.config import DFlashSection, VerifierSection
    from align.drafters.loading import new_dflash_drafter
    from align.models import load_tokenizer, load_verifier

    root, traj = toy_trajectories
    repo = Path(__file__).resolve().parents[2]
    verifier_path = str(root / "ck" / "verifier")
    tokenizer = load_tokenizer(verifier_path)
    torch.manual_seed(0)
    drafter, _ = new_dflash_drafter(VerifierSection(path=verifier_path),
                                    DFlashSection(aux_layer_ids=[0], draft_vocab_size=64),
                                    VerifierSection(path=verifier_path, device="cpu"), tokenizer.mask_token_id, 4)
    head = load_verifier(VerifierSection(path=verifier_path, device="cpu")).get_output_embeddings().weight
    # every other token from 5 on: not the most frequent ones a fresh run would pick from the trajectories
    set_draft_vocab(drafter, head, torch.arange(5, 5 + 2 * 64, 2))
    save_merged(drafter, tokenizer, tmp_path / "start", {})
    folder = tmp_path / "speculators"
    assert align(["export", "recipes/tiny/dflash.yaml", f"verifier.path={verifier_path}",
                  f"drafter.path={tmp_path / 'start'}", "export.format=speculators", f"export.out={folder}"]) in (0, None)
    start = load_file(str(folder / "model.safetensors"))

    out = tmp_path / "run"
    args = [f"verifier.path={verifier_path}", f"trajectories.out={traj}", *TOY_TRAJECTORIES, "dflash=null",
            f"drafter.path={folder}", f"data.dir={root / 'data'}", f"train.out={out}", "train.gamma=4",
            "train.windows_per_sequence=4", "train.max_steps=2", "train.micro_batch_size=2", "train.eval_every=1000",
            "train.save_every=2", "train.final_eval_prompts=0", "train.warmup_steps=1", "train.lr=1e-3"]
    done = subprocess.run([sys.executable, "align/train.py", "recipes/tiny/dflash.yaml", *args], cwd=repo,
                          env=checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    trained = load_file(str(out / "step_2" / "model.safetensors"))
    assert torch.equal(trained["d2t"], start["d2t"]) and torch.equal(trained["t2d"], start["t2d"])
    moved = [name for name in ("fc.weight", "lm_head.weight", "layers.0.mlp.down_proj.weight")
             if not torch.equal(trained[name], start[name])]
    assert moved == ["fc.weight", "lm_head.weight", "layers.0.mlp.down_proj.weight"]
    # two AdamW steps at lr 1e-3 move a weight by at most ~2e-3; a random start would differ by its init's scale
    assert max((trained[name] - start[name]).abs().max().item() for name in moved) < 5e-3
    meta = json.loads((out / "step_2" / "meta.json").read_text())
    assert meta["drafter_base"] == str(folder)

    assert align(["eval", "recipes/tiny/dflash.yaml", f"verifier.path={verifier_path}", "dflash=null",
                  f"drafter.path={out / 'step_2'}", f"data.dir={root / 'data'}", f"eval.out={tmp_path / 'eval'}",
                  "eval.compare_drafters={}", "eval.methods=[ar, specdiff]", "eval.num_prompts=2", "eval.warmup=0",
                  "decode.max_new_tokens=8", "decode.gamma=3"]) in (0, None)
    methods = json.loads((tmp_path / "eval" / "eval.json").read_text())["methods"]
    assert methods["specdiff"]["exact_match"] == 1.0


def vllm_expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Weight names and shapes vLLM's qwen3_dflash `load_weights` takes from a speculators DFlash checkpoint (before
    its own stacking of q/k/v into qkv_proj and gate/up into gate_up_proj), read off that model's modules:
    `fc` over the concatenated aux hidden states, `hidden_norm`, per layer q/k/v/o projections with q/k RMS norms
    over head_dim, a SiLU MLP and two layer norms, the final `norm`, and the optional embed_tokens/lm_head (the
    lm_head of draft_vocab_size rows, mapped by d2t)."""
    H, hd, V = config.hidden_size, config.head_dim, config.vocab_size
    q, kv, inter = config.num_attention_heads * hd, config.num_key_value_heads * hd, config.intermediate_size
    draft_vocab = config.draft_vocab_size or V
    shapes = {"fc.weight": (H, len(config.aux_hidden_state_layer_ids) * config.target_hidden_size),
              "hidden_norm.weight": (H,), "norm.weight": (H,), "embed_tokens.weight": (V, H),
              "lm_head.weight": (draft_vocab, H)}
    if config.draft_vocab_size:  # a pruned head: vLLM loads d2t as draft_id_to_target_id and skips t2d
        shapes.update({"d2t": (draft_vocab,), "t2d": (V,)})
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                       p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
                       p + "mlp.down_proj.weight": (H, inter), p + "input_layernorm.weight": (H,),
                       p + "post_attention_layernorm.weight": (H,)})
    return shapes


@pytest.mark.slow
@pytest.mark.parametrize("draft_vocab_size", [None, 64])
def test_speculators_export_matches_what_vllm_loads_and_reloads_with_identical_logits(toy_family, tmp_path,
                                                                                       draft_vocab_size, monkeypatch,
                                                                                       capsys):
    import json

    from safetensors.torch import load_file

    from align.checkpoint import save_merged
    from align.cli import main as align
    from align.config import DFlashSection, VerifierSection
    from align.drafters.dflash import DFlashContext, dflash_block_logits
    from align.drafters.speculators_format import load_speculators_dflash
    from align.drafters.base import aux_hidden
    from align.models import load_tokenizer, load_verifier
    from align.drafters.loading import new_dflash_drafter

    root, _ = toy_family
    verifier_path = str(root / "ck" / "verifier")
    tokenizer = load_tokenizer(verifier_path)
    torch.manual_seed(0)
    drafter, _ = new_dflash_drafter(VerifierSection(path=verifier_path),
                                    DFlashSection(aux_layer_ids=[0], draft_vocab_size=draft_vocab_size),
                                    VerifierSection(path=verifier_path, device="cpu"), tokenizer.mask_token_id, 4)
    if draft_vocab_size:
        from align.drafters.dflash import set_draft_vocab
        head = load_verifier(VerifierSection(path=verifier_path, device="cpu")).get_output_embeddings().weight
        set_draft_vocab(drafter, head, torch.arange(3, 3 + 2 * draft_vocab_size, 2))
    save_merged(drafter, tokenizer, tmp_path / "step_1", {})
    out = tmp_path / "export"
    assert align(["export", "recipes/tiny/dflash.yaml", f"verifier.path={verifier_path}",
                  f"drafter.path={tmp_path / 'step_1'}", "export.format=speculators", f"export.out={out}"]) in (0, None)

    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash"
    assert config["speculators_config"]["algorithm"] == "dflash"
    assert config["speculators_config"]["proposal_methods"][0] == {
        "proposal_type": "greedy", "speculative_tokens": 4, "verifier_accept_k": 1, "accept_tolerance": 0.0}
    # No path of the exporting machine in the folder (issue 14): a local verifier outside the working folder is
    # named by its folder's name (a Hub id, or a path under the align checkout, would stay as it is).
    assert config["speculators_config"]["verifier"]["name_or_path"] == "verifier"
    assert (config["block_size"], config["mask_token_id"]) == (5, tokenizer.mask_token_id)
    assert config["aux_hidden_state_layer_ids"] == [0]
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == (draft_vocab_size or config["transformer_layer_config"]["vocab_size"])
    weights = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in weights.items()} == vllm_expected_shapes(drafter.config)
    assert "vllm serve" in (out / "README.md").read_text()

    verifier = load_verifier(VerifierSection(path=verifier_path, device="cpu"))
    reloaded = load_speculators_dflash(str(out))
    ids = torch.tensor([tokenizer("def add(a, b):\n    return").input_ids])
    hidden = aux_hidden(verifier(input_ids=ids, output_hidden_states=True).hidden_states, [0])
    logits = []
    for model in (drafter.eval(), reloaded):
        context = DFlashContext()
        context.extend(model, hidden[:, :-1])
        logits.append(dflash_block_logits(model, verifier, ids[:, -1:], 4, context))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)

    # align reads its own speculators export back as a drafter (issue 36): the Python API decodes AR's greedy tokens
    # with it, and a speculators drafter of another algorithm is refused by name before any weights load
    import align as align_api
    from align.config import RecipeError

    pair = align_api.load(verifier=verifier_path, drafter=str(out))
    drafted = pair.generate(["def add(a, b):"], method="specdiff_tree", max_new_tokens=12)[0]
    assert drafted.token_ids == pair.generate(["def add(a, b):"], method="ar", max_new_tokens=12)[0].token_ids
    eagle = tmp_path / "eagle3"
    eagle.mkdir()
    (eagle / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    (eagle / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    with pytest.raises(RecipeError, match=r"^drafter\.path: .*eagle3 is a speculators eagle3 drafter; align runs"):
        align_api.load(verifier=verifier_path, drafter=str(eagle))

    # Pushed, the config would name its verifier "verifier": refused before any work unless the Hub id is given
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_TOKEN", "hf_fake")
    capsys.readouterr()
    never = tmp_path / "never"
    assert align(["export", "recipes/tiny/dflash.yaml", f"verifier.path={verifier_path}",
                  f"drafter.path={tmp_path / 'step_1'}", "export.format=speculators", f"export.out={never}",
                  "--push-to-hub", "me/drafter"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("align export: error: export.verifier_hub_id: the verifier") and not never.exists()


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_runtime_drafts_from_exactly_the_verified_context(monkeypatch, temperature):
    """Every draft the runtime makes must equal a draft made from scratch: the verifier's states of all tokens before
    the anchor (recomputed in one forward over the final sequence) and the anchor at that position. Catches a context
    that lags or runs ahead of the verifier, which stays lossless but silently costs acceptance."""
    from align.drafters.dflash import DFlashContext, dflash_block_logits
    from align.drafters.base import aux_hidden
    from align.drafters import conditioned

    verifier = tiny_verifier()
    drafter = tiny_dflash(verifier)
    spec = drafter_spec_from_config(drafter.config)
    calls = []

    def recorded(drafter, verifier, anchor_ids, num_draft, context):
        logits = dflash_block_logits(drafter, verifier, anchor_ids, num_draft, context)
        calls.append((context.length, int(anchor_ids[0, 0]), logits))
        return logits

    monkeypatch.setattr(conditioned, "dflash_block_logits", recorded)
    prompt = torch.randint(0, MASK, (1, 6), generator=torch.Generator().manual_seed(3))
    tokens, _ = specdiff_generate(verifier, drafter, spec, prompt, 3, 20, Sampling(temperature),
                                  generator=torch.Generator().manual_seed(0))
    sequence = torch.cat([prompt, torch.tensor([tokens])], dim=1)
    hidden = aux_hidden(verifier(input_ids=sequence, output_hidden_states=True).hidden_states,
                        drafter.config.aux_hidden_state_layer_ids)
    assert len(calls) > 3
    for length, anchor, logits in calls:
        assert anchor == int(sequence[0, length])  # the anchor is the first token the context does not cover
        context = DFlashContext()
        context.extend(drafter, hidden[:, :length])
        expected = dflash_block_logits(drafter, verifier, sequence[:, length: length + 1], logits.shape[1], context)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


def test_draft_layers_start_as_the_verifier_layers_named(tmp_path):
    # dflash.init_from_layers: each draft layer's projections and norms are the named verifier layer's, read from the
    # verifier's safetensors; what the verifier has no counterpart of (fc, the q/k norms of a Llama) stays as built.
    from align.config import DFlashSection, ModelSection, RecipeError
    from align.drafters.loading import new_dflash_drafter

    verifier = tiny_verifier()
    verifier.save_pretrained(tmp_path / "verifier")
    settings = DFlashSection(num_layers=2, init_from_layers=[3, 1])
    placed = ModelSection(path=str(tmp_path / "drafter"), dtype="float32")  # the new drafter's device and dtype
    drafter, _ = new_dflash_drafter(ModelSection(path=str(tmp_path / "verifier")), settings,
                                    placed, MASK, 4)
    for draft, source in ((0, 3), (1, 1)):
        mine, theirs = drafter.layers[draft], verifier.model.layers[source]
        for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj", "input_layernorm",
                     "post_attention_layernorm"):
            assert torch.equal(mine.get_submodule(name).weight, theirs.get_submodule(name).weight), (draft, name)
        assert torch.equal(mine.self_attn.q_norm.weight, torch.ones(8))
    random, _ = new_dflash_drafter(ModelSection(path=str(tmp_path / "verifier")), DFlashSection(num_layers=2),
                                   placed, MASK, 4)
    assert not torch.equal(random.layers[0].mlp.down_proj.weight, verifier.model.layers[3].mlp.down_proj.weight)
    with pytest.raises(RecipeError, match=r"^dflash.init_from_layers: \[4, 1\] must be below the verifier's 4"):
        new_dflash_drafter(ModelSection(path=str(tmp_path / "verifier")), DFlashSection(num_layers=2,
                           init_from_layers=[4, 1]), placed, MASK, 4)
    with pytest.raises(RecipeError, match="dflash.intermediate_size must be unset"):
        new_dflash_drafter(ModelSection(path=str(tmp_path / "verifier")), DFlashSection(
            num_layers=2, init_from_layers=[3, 1], intermediate_size=48), placed, MASK, 4)
    with pytest.raises(ValueError, match="one each"):
        DFlashSection(num_layers=2, init_from_layers=[3])
