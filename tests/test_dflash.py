"""The DFlash drafter kind (align/dflash.py): lossless in the runtime, trainable with every window loss, exported in
the speculators format that vLLM's qwen3_dflash loads."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from align.decoding.ar import ar_generate
from align.decoding.generation import Sampling
from align.decoding.specdiff import specdiff_generate
from align.dflash import DFlashDrafter, config_for_verifier
from align.models import drafter_spec_from_config

VOCAB, MASK = 32, 31


def tiny_verifier(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def tiny_dflash(verifier: LlamaForCausalLM, seed: int = 1) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter(config_for_verifier(verifier.config, MASK, num_layers=2, intermediate_size=48)).eval()


def test_spec_says_dflash():
    verifier = tiny_verifier()
    spec = drafter_spec_from_config(tiny_dflash(verifier).config)
    assert (spec.kind, spec.mask_token_id, spec.logits_shift) == ("dflash", MASK, 0)


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


def test_training_windows_see_what_the_runtime_shows_the_drafter():
    """A training window at start s must give the logits the runtime gets when it drafts after position s-1 with the
    context grown token by token: same context (positions before the anchor), same anchor, same positions."""
    from align.dflash import DFlashContext, aux_hidden, dflash_block_logits, dflash_window_logits

    verifier = tiny_verifier()
    drafter = tiny_dflash(verifier)
    ids = torch.randint(0, MASK, (1, 14), generator=torch.Generator().manual_seed(0))
    hidden = aux_hidden(verifier(input_ids=ids, output_hidden_states=True).hidden_states,
                        drafter.config.aux_hidden_state_layer_ids)
    starts = torch.tensor([[3, 8, 10]])
    windows, verifier_logits = dflash_window_logits(drafter, verifier, ids, starts, 4)
    torch.testing.assert_close(verifier_logits[0, 1, 0], verifier(input_ids=ids).logits[0, 7])
    for w, start in enumerate(starts[0].tolist()):
        context = DFlashContext()
        for i in range(0, start - 1, 3):  # grown in uneven steps, as accepted tokens arrive
            context.extend(drafter, hidden[:, i: min(i + 3, start - 1)])
        expected = dflash_block_logits(drafter, verifier, ids[:, start - 1: start], 4, context)
        torch.testing.assert_close(windows[:, w], expected, rtol=1e-4, atol=1e-5)
