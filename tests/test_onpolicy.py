"""train.data_mode=rejections (align/onpolicy.py) and the draft_opd loss: the anchors the walk visits are those greedy
chain decoding visits in the runtime, the windows kept are its rejections, and the loss is Draft-OPD's."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from align.decoding.ar import ar_generate
from align.decoding.generation import Sampling
from align.decoding.specdiff import specdiff_generate
from align.drafters import drafter_for
from align.drafters.dflash import DFlashDrafter, DraftVocab, config_for_verifier, dflash_window_logits, set_draft_vocab
from align.drafters.spec import drafter_spec_from_config
from align.losses import OPD_DECAY, draft_opd
from align.onpolicy import anchor_batch, num_accepted, rejection_batch, visited_windows

ROOT = Path(__file__).resolve().parents[1]
VOCAB, MASK, GAMMA, NEW = 32, 31, 4, 24
KEEP = (0, 2, 3, 5, 8, 13, 21, 30)  # a pruned draft vocabulary's tokens, with those of the verifier's answers


def half_trained_pair(pruned: bool) -> tuple[LlamaForCausalLM, DFlashDrafter, list[torch.Tensor], list[list[int]]]:
    """A tiny float32 verifier, three prompts and its greedy answers to them, and a DFlash drafter trained on those
    answers until it drafts some of them right and some wrong: a walk with both kept drafts and rejections."""
    torch.manual_seed(0)
    verifier = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=256)).eval().requires_grad_(False)
    prompts = [torch.randint(0, MASK, (1, 5), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    answers = [ar_generate(verifier, p, NEW, Sampling())[0] for p in prompts]
    torch.manual_seed(1)
    size = None
    if pruned:  # the answers' tokens and a few more, so that most drafts can be right
        keep = sorted(set(KEEP) | {t for a in answers for t in a})
        size = len(keep)
    drafter = DFlashDrafter(config_for_verifier(verifier.config, MASK, num_layers=2, intermediate_size=48,
                                                draft_vocab_size=size))
    if pruned:
        set_draft_vocab(drafter, verifier.get_output_embeddings().weight, torch.tensor(keep))
    vocab = DraftVocab.of(drafter)
    clean = torch.stack([torch.cat([p[0], torch.tensor(a)]) for p, a in zip(prompts, answers)])
    starts = torch.arange(6, clean.shape[1] - GAMMA + 1, 2).expand(len(prompts), -1)
    labels = clean.gather(1, (starts[..., None] + torch.arange(GAMMA)).flatten(1)).view(*starts.shape, GAMMA)
    if vocab is not None:
        labels = vocab.draft_ids[labels]
    optimiser = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(40):  # short of memorising: the walk must meet rejections too
        logits, _ = dflash_window_logits(drafter, verifier, clean, starts, GAMMA)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 2), labels.flatten())
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return verifier, drafter.eval().requires_grad_(False), prompts, answers


@pytest.fixture(scope="module", params=[False, True], ids=["full-head", "pruned-head"])
def pair(request):
    return half_trained_pair(request.param)


def runtime_walk(verifier, drafter, prompt) -> list[tuple[int, int]]:
    """(offset, drafts kept) at every step of the runtime's greedy chain decoding of `prompt`."""
    _, stats = specdiff_generate(verifier, drafter, drafter_spec_from_config(drafter.config), prompt, GAMMA, NEW)
    walk, offset = [], 1  # the prefill gives the first token; the first draft follows it
    for kept in stats.accept_counts:
        walk.append((offset, kept))
        offset += kept + 1
    return walk


def test_the_walk_over_every_anchor_is_the_runtime_s_greedy_chain_decoding(pair):
    verifier, drafter, prompts, answers = pair
    spec = drafter_spec_from_config(drafter.config)
    vocab = DraftVocab.of(drafter)
    kept_any = rejected_any = False
    for prompt, answer in zip(prompts, answers):
        clean = torch.cat([prompt[0], torch.tensor(answer)])[None]
        p = prompt.shape[1]
        everywhere = anchor_batch(clean, [p], [list(range(len(answer)))], GAMMA, 0, None)
        logits, _ = drafter_for(drafter, spec).window_logits(everywhere, verifier)
        drafts = logits.argmax(-1)
        drafts = drafts if vocab is None else vocab.target_ids[drafts]
        accepted = num_accepted(drafts, everywhere.targets, everywhere.target_mask)[0].tolist()
        walk = visited_windows(len(answer), accepted)
        assert walk == runtime_walk(verifier, drafter, prompt)
        kept_any |= any(kept > 0 for _, kept in walk)
        rejected_any |= any(kept < min(GAMMA, len(answer) - offset) for offset, kept in walk)
    assert kept_any and rejected_any  # the fixture's drafter is half-trained: both happen


def test_the_windows_kept_are_the_runtime_s_rejections_with_what_verification_saw(pair):
    verifier, drafter, prompts, answers = pair
    spec = drafter_spec_from_config(drafter.config)
    rows = [{"prompt_ids": p[0].tolist(), "completion_ids": a} for p, a in zip(prompts, answers)]
    clean = torch.stack([torch.cat([p[0], torch.tensor(a)]) for p, a in zip(prompts, answers)])
    batch = anchor_batch(clean, [5, 5, 5], [[0]] * 3, GAMMA, 0, None)
    out = rejection_batch(drafter, spec, verifier, batch, rows, GAMMA, windows=100, pad_id=0,
                          rng=np.random.default_rng(0))
    for b, (prompt, answer) in enumerate(zip(prompts, answers)):
        expected = [(offset, kept) for offset, kept in runtime_walk(verifier, drafter, prompt)
                    if kept < min(GAMMA, len(answer) - offset)]
        real = out.target_mask[b].any(-1)
        got = list(zip((out.starts[b][real] - 5).tolist(), (out.target_mask[b][real].sum(-1) - 1).tolist()))
        assert got == expected
        for w in torch.nonzero(real).flatten().tolist():
            start = int(out.starts[b, w])
            label = clean[b, start : start + GAMMA].tolist()  # shorter at the completion's end: padding after it
            assert out.targets[b, w, : len(label)].tolist() == label
    # at most `windows` a row, drawn from the rejections
    few = rejection_batch(drafter, spec, verifier, batch, rows, GAMMA, windows=1, pad_id=0,
                          rng=np.random.default_rng(0))
    assert (few.target_mask.any(-1).sum(-1) <= 1).all() and few.target_mask.any(-1).sum() >= 1


def test_draft_opd_is_forward_kl_where_verification_looks_and_decayed_reverse_kl_at_the_rejection():
    torch.manual_seed(0)
    verifier_logits = torch.randn(2, 4, 6)
    draft_logits = torch.randn(2, 4, 6, requires_grad=True)
    with torch.no_grad():  # window 0: positions 0, 1 agree, 2 is rejected; window 1: position 0 is rejected
        draft_logits[0, :2] = verifier_logits[0, :2] * 3
        draft_logits[0, 2] = -verifier_logits[0, 2]
        draft_logits[1, 0] = -verifier_logits[1, 0]
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    loss = draft_opd(draft_logits, verifier_logits, mask, num_windows=2)

    log_p, log_q = verifier_logits.log_softmax(-1), draft_logits.log_softmax(-1)
    fkl = (log_p.exp() * (log_p - log_q)).sum(-1)
    rkl = (log_q.exp() * (log_q - log_p)).sum(-1)
    expected = (fkl[0, :3].sum() + OPD_DECAY**2 * rkl[0, 2] + fkl[1, 0] + rkl[1, 0]) / 2
    torch.testing.assert_close(loss, expected)
    loss.backward()
    # what verification never reaches (after a rejection) gets no gradient
    assert draft_logits.grad[0, 3].abs().sum() == 0 and draft_logits.grad[1, 1:].abs().sum() == 0
    assert draft_logits.grad[0, 2].abs().sum() > 0
    # a drafter that is the verifier loses nothing
    same = verifier_logits.clone().requires_grad_(True)
    assert draft_opd(same, verifier_logits, mask, num_windows=2).item() == pytest.approx(0.0, abs=1e-6)


def run_train(args: list[str], ranks: int = 1) -> subprocess.CompletedProcess:
    from align.launch import free_port
    from conftest import checkout_env

    launcher = ([str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port",
                 str(free_port())] if ranks > 1 else [sys.executable])
    return subprocess.run([*launcher, "align/train.py", "recipes/tiny/dflash.yaml", *args], cwd=ROOT,
                          env=checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                          timeout=600)


def test_a_drafter_that_is_not_dflash_is_refused_before_any_work(toy_family, tmp_path):
    root, _ = toy_family
    done = run_train([f"verifier.path={root / 'ck' / 'verifier'}", "dflash=null",
                      f"drafter.path={root / 'ck' / 'drafter-base'}", f"data.dir={root / 'data'}",
                      "train.data_mode=rejections", "train.losses={draft_opd: 1.0}", f"train.out={tmp_path / 'never'}"])
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "train.data_mode: rejections" in done.stderr and "standalone drafter" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "never").exists()


@pytest.mark.slow
def test_a_second_stage_on_rejections_starts_from_the_trained_drafter_on_two_ranks(toy_trajectories, tmp_path):
    """Supervised steps, then a draft_opd stage from that step (drafter.path, no dflash section: the trained drafter
    is the start) on the windows greedy decoding rejected, on 2 DeepSpeed ranks: its weights start as the first
    run's (not random), they move, and the loss is finite."""
    from conftest import TOY_TRAJECTORIES
    from safetensors.torch import load_file

    root, traj = toy_trajectories
    common = [f"verifier.path={root / 'ck' / 'verifier'}", f"trajectories.out={traj}", *TOY_TRAJECTORIES,
              f"data.dir={root / 'data'}", "train.gamma=4", "train.micro_batch_size=2", "train.eval_every=100",
              "train.final_eval_prompts=0", "dflash.aux_layer_ids=[0]", "dflash.intermediate_size=48",
              "dflash.draft_vocab_size=128", "train.warmup_steps=1"]
    first = tmp_path / "supervised"
    done = run_train([*common, f"train.out={first}", "train.max_steps=4", "train.save_every=4",
                      "train.windows_per_sequence=4"])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    second = tmp_path / "opd"
    done = run_train([*common, f"train.out={second}", "train.max_steps=3", "train.save_every=3",
                      "train.data_mode=rejections", "train.losses={draft_opd: 1.0}", "train.windows_per_sequence=2",
                      "train.lr=1e-4", "dflash=null", f"drafter.path={first / 'step_4'}"], ranks=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    start = load_file(str(first / "step_4" / "model.safetensors"))
    trained = load_file(str(second / "step_3" / "model.safetensors"))
    assert torch.equal(trained["d2t"], start["d2t"])  # the first run's vocabulary, not one ranked again
    moved = (trained["fc.weight"] - start["fc.weight"]).abs().max().item()
    assert 0 < moved < 1e-3  # three steps at 1e-4 from the first run's weights, not from a random start
    metrics = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3 and all(np.isfinite(m["loss"]) for m in metrics)
