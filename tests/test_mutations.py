"""The lossless tests can fail: bugs that break losslessness are planted in a copy of align/, and the tests named for
each must fail on it (issue 22: four planted bugs passed the earlier sampling tests).

Each mutation is an exact source replacement that must match once, so that this check breaks loudly when the code it
plants into moves (then move the replacement with it). The named tests run in a subprocess whose working directory
holds the mutant copy, which `import align` finds before any installed one, two subprocesses at a time. A test counts
as catching a bug only if it fails an assertion (a crash or an import error would not say the test has the power).

Run alone: `python -m pytest -q tests/test_mutations.py` (20 mutants over two processes; the 12 of 2026-12-01 took 618
s of wall time on a 2-core machine shared with other jobs; marked slow).
"""

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this file out; CI runs it

ROOT = Path(__file__).resolve().parents[1]
SAMPLING = "tests/decoding/test_sampling_lossless.py::"
EVERY_METHOD = SAMPLING + "test_every_method_samples_the_verifier_distribution"
SLIDING = SAMPLING + "test_every_method_samples_a_sliding_window_verifiers_distribution"
CUSTOM = "tests/test_custom_generate.py::"
LOW_TEMPERATURE = SAMPLING + "test_the_verifier_distribution_is_sampled_at_a_low_temperature"
RULES = "tests/decoding/test_acceptance.py::test_sampled_rules_reproduce_the_verifier_distribution"


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # under align/
    old: str
    new: str
    tests: tuple[str, ...]  # test ids (relative to the repository) that must each fail


MUTATIONS = (
    # The four that passed the earlier tests (issue 22's table), then defect 1 itself, then ones they caught.
    Mutation("residual = p: after a rejection, sample the verifier's p, not norm(max(p - q, 0))",
             "decoding/acceptance.py", "fallback = residual(verifier_probs[num_accepted], draft_probs[num_accepted])",
             "fallback = verifier_probs[num_accepted]", (EVERY_METHOD + "[sd_ar]", EVERY_METHOD + "[specdiff]")),
    Mutation("a draft sampled from the truncated q, accepted against the untruncated q",
             "decoding/specdiff.py", "draft = torch.multinomial(draft_probs, 1, generator=self.generator).squeeze(-1)",
             "draft = torch.multinomial(draft_probs, 1, generator=self.generator).squeeze(-1); "
             "draft_probs = Sampling(self.draft_sampling.temperature).probs(draft_logits)",
             (SAMPLING + "test_truncated_sampling_is_lossless[specdiff-top_k]",
              SAMPLING + "test_truncated_sampling_is_lossless[specdiff-top_p]")),
    Mutation("tree: after every child is rejected, sample p instead of the residual",
             "decoding/acceptance.py", "return path, int(sample(target, generator))",
             "return path, int(sample(verifier_probs[row], generator))",
             (EVERY_METHOD + "[specdiff_tree]", EVERY_METHOD + "[specdiff_cps_tree]")),
    Mutation("defect 1: a sampled draft's cost-aware length chosen from the tokens drawn",
             "decoding/specdiff.py", "scored = draft if draft_probs is None else raw_draft[:draft_len]",
             "scored = draft",
             (SAMPLING + "test_a_cost_aware_length_is_lossless_against_a_drafter_that_would_bias_it",
              "tests/decoding/test_sizing.py::test_a_sampled_drafts_length_is_chosen_before_it_is_drawn")),
    Mutation("acceptance ratio inverted: q/p for p/q", "decoding/acceptance.py",
             "accepted = (u * draft_p < verifier_p)", "accepted = (u * verifier_p < draft_p)",
             (EVERY_METHOD + "[specdiff]",)),
    Mutation("the verifier's cache not cropped after a rejection", "decoding/speculative.py",
             "cache.crop(-(len(draft) - num_accepted))", "None", (EVERY_METHOD + "[specdiff]",)),
    Mutation("self-selection: the target not replaced by the residual after a candidate is rejected",
             "decoding/acceptance.py", "target = residual(target, draft_probs[depth])", "target = target",
             (EVERY_METHOD + "[specdiff2_select]",)),
    Mutation("the bonus token drawn from the last draft position's distribution", "decoding/acceptance.py",
             "return gamma, int(sample(verifier_probs[gamma], generator))",
             "return gamma, int(sample(verifier_probs[gamma - 1], generator))", (EVERY_METHOD + "[specdiff_cost]",)),
    # Issue 22 defect 4 and the sliding verifiers: a sliding layer's window left out of a mask align builds. The
    # sampled test sees it on the verifier whose every layer slides (p ≈ 1e-34); on Qwen2's, one sliding layer of two,
    # it moves the distribution less (p ≈ 0.05 at 1,000 decodes), and the node-by-node tree check catches it.
    Mutation("a verifier's tree mask (and a cached drafter's block mask) without its sliding window", "masks.py",
             "sees = sees & in_window(None, None, positions[:, :, None], key_positions[:, None, :])", "None",
             (SLIDING + "[mistral_sliding-specdiff_tree]",
              "tests/decoding/test_tree.py::test_tree_forward_scores_each_node_as_a_plain_forward_over_its_path[qwen2_sliding]")),
    Mutation("custom_generate: a sliding drafter's block mask without its window", "custom_generate.py",
             "sees = sees & (key_positions[None, :] > positions[:, None] - window)", "None",
             (CUSTOM + "test_a_sliding_window_drafter_decodes_as_align_does[mistral_sliding-1]",
              CUSTOM + "test_a_sliding_window_drafter_decodes_as_align_does[qwen2_sliding-1]")),
    # custom_generate restates the acceptance rule: its own planted bug, caught by its own sampled test.
    Mutation("custom_generate: after a rejection, sample the verifier's p, not norm(max(p - q, 0))",
             "custom_generate.py", "residual = diff / diff.sum() if diff.sum() > 0 else verifier_probs[num_accepted]",
             "residual = verifier_probs[num_accepted]", (CUSTOM + "test_sampling_is_the_verifiers_distribution[llama-chain]",)),
    # Issue 37: a model-free draft has no q; accepting it as if drawn from one (here half the mass on the token, the
    # rest spread over the table models' 6 tokens) keeps it too often and corrects from the wrong residual.
    Mutation("an n-gram continuation accepted against a drafter's q instead of as a point mass", "decoding/ngram.py",
             "return Draft(draft, None, len(tokens), forwards=0)",
             "return Draft(draft, torch.nn.functional.one_hot(draft, 6) * 0.5 + 0.5 / 6, len(tokens), forwards=0)",
             (EVERY_METHOD + "[ngram]", EVERY_METHOD + "[ngram_cost]")),
    # Issue 33: three that passed the tests of the time, and one caught only as a crash. At temperature 0.9 the
    # verifier's tempered and untempered distributions barely differ; at 0.5 they are far apart.
    Mutation("the residual from the verifier's distribution at temperature 1 (the ratio at the temperature)",
             "decoding/acceptance.py", "    return accept_sampled(draft_tokens, draft_probs, verifier_probs, generator)",
             "    num_accepted, token = accept_sampled(draft_tokens, draft_probs, verifier_probs, generator)\n"
             "    if num_accepted == len(draft_tokens):\n        return num_accepted, token\n"
             "    untempered = Sampling(1.0, sampling.top_k, sampling.top_p).probs(verifier_logits)\n"
             "    return num_accepted, int(sample(residual(untempered[num_accepted], draft_probs[num_accepted]), "
             "generator))",
             (LOW_TEMPERATURE + "[specdiff]",)),
    Mutation("the acceptance ratio from the verifier's distribution at temperature 1 (the residual at the temperature)",
             "decoding/acceptance.py", "    return accept_sampled(draft_tokens, draft_probs, verifier_probs, generator)",
             "    untempered = Sampling(1.0, sampling.top_k, sampling.top_p).probs(verifier_logits)\n"
             "    num_accepted, _ = accept_sampled(draft_tokens, draft_probs, untempered, generator)\n"
             "    if num_accepted == len(draft_tokens):\n"
             "        return num_accepted, int(sample(verifier_probs[num_accepted], generator))\n"
             "    return num_accepted, int(sample(residual(verifier_probs[num_accepted], draft_probs[num_accepted]), "
             "generator))",
             (LOW_TEMPERATURE + "[specdiff]",)),
    Mutation("custom_generate: the bonus token drawn from the last draft position's row", "custom_generate.py",
             "return gamma, int(torch.multinomial(verifier_probs[gamma], 1))",
             "return gamma, int(torch.multinomial(verifier_probs[gamma - 1], 1))",
             (RULES + "[custom_generate]",)),
    # Issue 37: custom_generate's union walk restates the tree rule: its own planted bugs, caught by its own tests.
    Mutation("custom_generate: a rejected union node's token left in the distribution the next child is tried against",
             "custom_generate.py", "            target = target.clone()\n            target[token] = 0\n",
             "            target = target.clone()\n",
             (RULES + "[custom_generate_tree]",)),
    Mutation("custom_generate: a union row's scores processed after the context, not after the row's own path",
             "custom_generate.py",
             "prefix = torch.cat([context, context.new_tensor([[tree.tokens[n] for n in path]])], dim=1)",
             "prefix = context",
             (CUSTOM + "test_greedy_is_generates_greedy_with_every_processor[repetition_penalty-accepting-drafter-union]",
              CUSTOM + "test_greedy_is_generates_greedy_with_every_processor[no_repeat_ngram_size-accepting-drafter-union]")),
    Mutation("self-selection: the first candidate's cache rows kept, not the chosen one's", "decoding/self_selection.py",
             "cache.batch_select_indices(torch.tensor([chosen], device=inputs.device))",
             "cache.batch_select_indices(torch.tensor([0], device=inputs.device))",
             (SAMPLING + "test_truncated_sampling_is_lossless[specdiff2_select-top_k]",)),
    Mutation("a tree walk that stays on the accepted child's parent row", "decoding/acceptance.py",
             "        path.append(chosen)\n        row = chosen + 1", "        path.append(chosen)\n        row = chosen",
             (RULES + "[tree]",)),
    Mutation("HF's baselines without an attention mask: generate() hides every prompt token equal to the pad token",
             "methods.py", "prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens",
             "prompt_ids, max_new_tokens",
             ("tests/decoding/test_verifier_families.py::test_greedy_hf_baselines_equal_ar_for_every_verifier_family[llama]",)),
)


def plant(mutation: Mutation, folder: Path) -> Path:
    """folder/align: a copy of align/ with `mutation` applied. Returns folder."""
    shutil.copytree(ROOT / "align", folder / "align", ignore=shutil.ignore_patterns("__pycache__"))
    source = folder / "align" / mutation.path
    text = source.read_text()
    assert text.count(mutation.old) == 1, f"{mutation.name}: {mutation.old!r} is not in {mutation.path} exactly once"
    source.write_text(text.replace(mutation.old, mutation.new))
    return folder


def mutant_env(folder: Path) -> dict[str, str]:
    """The environment of a run against the mutant in `folder`: it goes first on PYTHONPATH (what PYTHONPATH held
    stays: an environment assembled there keeps its packages), one thread (two runs share the machine)."""
    path = os.pathsep.join(part for part in (str(folder), os.environ.get("PYTHONPATH", "")) if part)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def failed_by_assertion(report: Path) -> set[str]:
    """The test ids (file::name) that failed an assertion, from a JUnit XML report."""
    failed = set()
    for case in ElementTree.parse(report).iter("testcase"):
        failure = case.find("failure")
        message = (failure.get("message") or "") if failure is not None else ""
        # A plain assert reads "assert ...", torch.testing.assert_close's "AssertionError: ...".
        if "assert" in message or "AssertionError" in message:
            module = case.get("classname", "").replace(".", "/")
            failed.add(f"{module}.py::{case.get('name')}")
    return failed


def run_tests(mutation: Mutation, folder: Path) -> tuple[set[str], str]:
    report = folder / "report.xml"
    # No cache provider: it would write .pytest_cache into the checkout.
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={ROOT}",
                             f"--junitxml={report}", *[str(ROOT / test) for test in mutation.tests]],
                            cwd=folder, env=mutant_env(folder), capture_output=True, text=True, timeout=600)
    return (failed_by_assertion(report) if report.is_file() else set()), result.stdout[-3000:] + result.stderr[-2000:]


def test_every_mutation_still_matches_the_code_once():
    # Cheap, so a moved line is reported even where the slow check below is deselected.
    for mutation in MUTATIONS:
        text = (ROOT / "align" / mutation.path).read_text()
        assert text.count(mutation.old) == 1, f"{mutation.name}: {mutation.old!r} not once in {mutation.path}"


def test_a_mutant_copy_is_what_the_subprocess_imports(tmp_path):
    folder = plant(MUTATIONS[0], tmp_path)
    found = subprocess.run([sys.executable, "-c", "import align; print(align.__file__)"], cwd=folder,
                           env=mutant_env(folder), capture_output=True, text=True, check=True).stdout.strip()
    assert Path(found).resolve() == (folder / "align" / "__init__.py").resolve()


@pytest.mark.slow
def test_every_planted_bug_fails_the_tests_named_for_it(tmp_path):
    folders = [plant(mutation, tmp_path / f"mutant{i}") for i, mutation in enumerate(MUTATIONS)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run_tests, MUTATIONS, folders))
    missed = []
    for mutation, (failed, output) in zip(MUTATIONS, results):
        passed = [test for test in mutation.tests if test not in failed]
        if passed:
            missed.append(f"{mutation.name}: {', '.join(passed)} did not fail\n{output}")
    assert not missed, "\n\n".join(missed)
