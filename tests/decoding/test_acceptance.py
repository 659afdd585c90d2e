"""Acceptance rules: greedy is exact, and the sampled rules reproduce the verifier's distribution (chi-square).

The toy verifier is a Markov chain on a small vocabulary (its next-token distribution depends on the previous token),
so that a rule that ignored the prefix, or sampled the wrong thing after a rejection, would show in the joint
distribution of the first two emitted tokens.
"""

import pytest
import torch
from transformers import LogitsProcessorList

from align import custom_generate
from align.decoding.acceptance import (accept_greedy, accept_multi_candidate, accept_point_mass, accept_sampled,
                                       accept_tree)
from align.decoding.generation import Sampling
from align.decoding.sampling import logits_to_probs, sample

VOCAB, GAMMA, ROOT, TRIALS = 6, 3, 0, 12000


def make_problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    transitions = torch.distributions.Dirichlet(torch.full((VOCAB,), 0.7)).sample((VOCAB,))
    draft_probs = torch.distributions.Dirichlet(torch.full((VOCAB,), 0.7)).sample((GAMMA,))
    return transitions, draft_probs, gen


def verifier_along(transitions, state, draft):
    """(γ + 1, V): the verifier's distribution at each draft position and the bonus position."""
    states = torch.cat([torch.tensor([state]), draft])
    return transitions[states]


def first_two_tokens(propose_and_accept, transitions, gen):
    emitted, state = [], ROOT
    while len(emitted) < 2:
        accepted, next_token = propose_and_accept(state, gen)
        emitted += [*accepted, next_token]
        state = emitted[-1]
    return emitted[:2]


def chi_square_pvalue(samples, expected_probs):
    counts = torch.zeros(VOCAB * VOCAB)
    for a, b in samples:
        counts[a * VOCAB + b] += 1
    expected = expected_probs.flatten() * len(samples)
    small = expected < 5  # merge sparse cells so the chi-square approximation holds
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), stat / 2))


def joint_of_two(transitions):
    return transitions[ROOT][:, None] * transitions  # P(a, b) = p(a | root) p(b | a)


def run_rule(rule_name, seed=0):
    transitions, draft_probs, gen = make_problem(seed)

    def sampled(state, gen):
        draft = sample(draft_probs, gen)
        n, nxt = accept_sampled(draft, draft_probs, verifier_along(transitions, state, draft), gen)
        return draft[:n].tolist(), nxt

    def point_mass(state, gen):
        draft = draft_probs.argmax(-1)  # deterministic, as a beam search's or argmax's draft would be
        n, nxt = accept_point_mass(draft, verifier_along(transitions, state, draft), gen)
        return draft[:n].tolist(), nxt

    def multi(state, gen):
        candidates = sample(draft_probs.expand(3, GAMMA, VOCAB), gen)  # (K, γ)
        verifier = torch.stack([verifier_along(transitions, state, c) for c in candidates])
        n, nxt, k = accept_multi_candidate(candidates, draft_probs, verifier, gen)
        return candidates[k, :n].tolist(), nxt

    def broken(state, gen):
        # The classic mistake: after a rejection, sample from the verifier instead of the residual.
        draft = sample(draft_probs, gen)
        verifier = verifier_along(transitions, state, draft)
        n, _ = accept_sampled(draft, draft_probs, verifier, gen)
        return draft[:n].tolist(), int(sample(verifier[n], gen))

    def shipped(state, gen):
        # custom_generate's own restatement of the rule (it samples from the global generator), one draft token: its
        # bonus token is then the second emitted, which must follow p(· | the draft token), the row after it.
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        draft = sample(draft_probs[:1], gen)
        n, nxt = custom_generate.accept(draft, draft_probs[:1], verifier_along(transitions, state, draft), True)
        return draft[:n].tolist(), nxt

    def tree(state, gen):
        # Two children of the root (the drafter's two likeliest first tokens) and a grandchild under the first: row
        # r + 1 of the logits is the verifier's distribution after node r's path.
        first, second = draft_probs[0].topk(2).indices.tolist()
        grandchild = int(draft_probs[1].argmax())
        tokens, parents = [first, second, grandchild], [-1, -1, 0]
        rows = transitions[[state, first, second, grandchild]]
        path, nxt = accept_tree(tokens, [[0, 1], [2], [], []], rows.log(), Sampling(1.0), gen)
        assert all(parents[node] == (path[i - 1] if i else -1) for i, node in enumerate(path)), path  # a real path
        return [tokens[node] for node in path], nxt

    def shipped_tree(state, gen):
        # custom_generate's union walk over the same tree, each row's distribution processed after its own path (no
        # processors here: the softmax of the row's logits); it samples from the global generator.
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        first, second = draft_probs[0].topk(2).indices.tolist()
        grandchild = int(draft_probs[1].argmax())
        tree = custom_generate.Tree([first, second, grandchild], [-1, -1, 0], [1, 1, 2])
        rows = transitions[[state, first, second, grandchild]]
        choice = custom_generate.TokenChoice(LogitsProcessorList(), do_sample=True)
        path, nxt = custom_generate.walk(tree, rows.log(), torch.tensor([[state]]), choice)
        assert all(tree.parents[node] == (path[i - 1] if i else -1) for i, node in enumerate(path)), path
        return [tree.tokens[node] for node in path], nxt

    rule = {"sampled": sampled, "point_mass": point_mass, "multi_candidate": multi, "broken": broken,
            "custom_generate": shipped, "tree": tree, "custom_generate_tree": shipped_tree}[rule_name]
    samples = [first_two_tokens(rule, transitions, gen) for _ in range(TRIALS)]
    return chi_square_pvalue(samples, joint_of_two(transitions))


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["sampled", "point_mass", "multi_candidate", "custom_generate", "tree",
                                  "custom_generate_tree"])
def test_sampled_rules_reproduce_the_verifier_distribution(rule):
    """12,000 draws of the first two emitted tokens (36 cells, sparse ones merged): at the 1e-3 level a deviation of
    w ≥ 0.045 on their joint is detected with power 0.99. Planted in tests/test_mutations.py and caught here:
    custom_generate's bonus token from the last draft position's row (w ≈ 0.5 on these chains), and a tree walk that
    stays on the accepted child's parent row (its path fails the assertion above); custom_generate's union walk that
    keeps a rejected token in the distribution the next child is tried against."""
    assert run_rule(rule) > 1e-3


@pytest.mark.slow
def test_a_broken_rule_fails_the_same_test():
    assert run_rule("broken") < 1e-6


def test_greedy_keeps_the_prefix_matching_the_argmax():
    logits = torch.full((4, 5), -1.0)
    logits[0, 2] = logits[1, 4] = logits[2, 1] = logits[3, 0] = 1.0  # verifier argmax: 2, 4, 1, then bonus 0
    assert accept_greedy(torch.tensor([2, 4, 1]), logits) == (3, 0)
    assert accept_greedy(torch.tensor([2, 3, 1]), logits) == (1, 4)  # a match after a mismatch does not count
    assert accept_greedy(torch.tensor([0, 4, 1]), logits) == (0, 2)


def test_multi_candidate_at_temperature_zero_takes_the_longest_matching_candidate():
    verifier_tokens = torch.tensor([[1, 2, 3, 4]] * 3)
    verifier = torch.nn.functional.one_hot(verifier_tokens, 5).float()  # (K, γ + 1, V)
    candidates = torch.tensor([[1, 0, 0], [1, 2, 0], [4, 4, 4]])
    draft_probs = torch.full((3, 5), 0.2)
    assert accept_multi_candidate(candidates, draft_probs, verifier)[:2] == (2, 3)
    assert accept_multi_candidate(candidates, draft_probs, verifier)[2] == 1


def test_logits_to_probs_truncation():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert torch.equal(logits_to_probs(logits, 0.0), torch.tensor([1.0, 0, 0, 0]))
    top2 = logits_to_probs(logits, 1.0, top_k=2)
    assert (top2[2:] == 0).all() and torch.isclose(top2.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)
    nucleus = logits_to_probs(logits, 1.0, top_p=float(full[0]) + 1e-3)  # needs the top two tokens
    assert (nucleus > 0).tolist() == [True, True, False, False]
    assert torch.allclose(logits_to_probs(logits, 2.0), torch.softmax(logits / 2, -1))


def test_point_mass_rule_accepts_with_p_and_resamples_p_without_the_draft():
    # γ = 1, draft token x: P(keep x, bonus v) = p_0(x)·p_1(v) and P(reject, correction v) = p_0(v) for v ≠ x
    # (a rejection, probability 1 − p_0(x), samples p_0 with x removed and renormalised). Nothing else can happen.
    transitions, _, gen = make_problem(3)
    verifier, x = transitions[:2], 2
    expected = torch.cat([verifier[0][x] * verifier[1], verifier[0].index_fill(0, torch.tensor([x]), 0.0)])
    counts = torch.zeros(2 * VOCAB)
    for _ in range(TRIALS // 2):
        n, nxt = accept_point_mass(torch.tensor([x]), verifier, gen)
        counts[(1 - n) * VOCAB + nxt] += 1
    assert counts[expected == 0].sum() == 0  # a rejected x is never emitted again in its place
    exp = expected * counts.sum()
    keep = exp > 0
    stat = ((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    assert float(torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2), stat / 2)) > 1e-3
