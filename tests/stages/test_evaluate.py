"""`align eval` end to end on the toy family: every method is lossless at temperature 0, and bad input is refused."""

import json
import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from align.cli import main
from align.config import METHOD_NAMES
from align.stages.evaluate.speculative import drafter_groups
from align.methods import METHODS, OPAQUE

FIELDS = {"tau", "speedup", "tokens_per_s", "exact_match", "per_position_acceptance", "verifier_forwards",
          "drafter_forwards", "new_tokens", "wall_s", "ideal_speedup"}


def eval_args(root, out, *extra):
    ck = root / "ck"
    return ["eval", "recipes/tiny/eval.yaml", f"verifier.path={ck / 'verifier'}", f"drafter.path={ck / 'drafter-base'}",
            f"ar_drafter.path={ck / 'ar-drafter'}", f"data.dir={root / 'data'}", f"eval.out={out}",
            "eval.num_prompts=2", "decode.max_new_tokens=10", "eval.warmup=0", *extra]


def test_method_table_matches_the_schema():
    assert tuple(METHODS) == METHOD_NAMES


@pytest.fixture(scope="module")
def evaluated(toy_trajectories, tmp_path_factory):
    # Every method, the suffix ones too (not in eval.methods' default: they read a trajectories folder).
    root, trajectories = toy_trajectories
    out = tmp_path_factory.mktemp("eval")
    assert main(eval_args(root, out, "decode.gamma=4", "decode.num_candidates=3",
                          f"decode.suffix_corpus={trajectories}", f"eval.methods=[{', '.join(METHOD_NAMES)}]")) == 0
    return out, json.loads((out / "eval.json").read_text())


@pytest.mark.slow
def test_every_method_is_reported_and_exact_at_temperature_0(evaluated):
    _, result = evaluated
    assert set(result["methods"]) == set(METHOD_NAMES)
    for name, m in result["methods"].items():
        assert FIELDS <= set(m), name
        assert m["exact_match"] == 1.0, name
        assert m["new_tokens"] > 0 and m["wall_s"] > 0 and m["tau"] >= 1.0
    for name in ("sd_ar", "specdiff", "specdiff2_select", "specdiff_cps", "specdiff_adl", "specdiff_cps_adl",
                 "specdiff_tree", "specdiff_cost", "specdiff_cps_cost", "specdiff_tree_cost", "specdiff_cps_tree",
                 "specdiff_cps_tree_cost"):
        m = result["methods"][name]
        alphas = m["per_position_acceptance"]
        assert m["ideal_speedup"] > 0 and m["verifier_forwards"] > 0, name
        # One α per draft position up to the longest draft: γ = 4, except ADL, which starts at its maximum length
        # (the default 16, cut to the 9 tokens left after the first one); CPS paths may stop early at EOS.
        longest = 9 if name.endswith("adl") else 4
        if "cps" in name or name.endswith("cost"):  # a cost-aware draft may stop short of γ
            assert 1 <= len(alphas) <= longest, name
        else:
            assert len(alphas) == longest, name
        assert alphas[0] is not None and all(a is None or 0.0 <= a <= 1.0 for a in alphas), name
        assert m["tau"] <= 1 + longest, name
    assert result["methods"]["specdiff"]["drafter_forwards"] == result["methods"]["specdiff"]["verifier_forwards"]
    assert "draft_length_trace" in result["methods"]["specdiff_adl"]
    # The cost-aware methods: their chosen sizes traced, the cost curve they chose by in meta.
    assert 1 <= min(result["methods"]["specdiff_cost"]["draft_length_trace"])
    assert max(result["methods"]["specdiff_cost"]["draft_length_trace"]) <= 4
    assert max(result["methods"]["specdiff_tree_cost"]["draft_length_trace"]) <= 16  # recipes/tiny/eval.yaml's nodes
    costs = result["meta"]["verify_costs_s"]
    assert len(costs) == 16 + 1 and costs == sorted(costs)  # up to the tree's nodes and its root


@pytest.mark.slow
def test_sampled_run_and_report(evaluated):
    out, result = evaluated
    assert result["sampling"]["temperature"] == 1.0
    assert all(m["exact_match"] is None for m in result["sampling"]["methods"].values())
    report = (out / "report.md").read_text()
    assert "| specdiff2_select |" in report and "Temperature 0" in report
    for plot in ("tau.png", "speedup.png", "acceptance.png", "adl_trace.png"):
        assert (out / plot).stat().st_size > 1000
    assert result["meta"]["num_prompts"] == 2 and result["meta"]["command"].startswith("align eval")


def tiny_test_ids(root, n):
    """The ids (task_id) of the first n prompts of the tiny test split the toy family evaluates on."""
    rows = (root / "data" / "prompts" / "test.jsonl").read_text().splitlines()[:n]
    return [json.loads(row)["task_id"] for row in rows]


def check_records(methods, ids):
    """Each method's per-prompt records (eval.json schema 2) name the prompts `ids` and add up to its aggregates."""
    num_prompts = len(ids)
    for name, m in methods.items():
        records = m["records"]
        assert [(r["index"], r["row"], r["id"]) for r in records] == [(i, i, ids[i]) for i in range(num_prompts)], name
        assert sum(r["new_tokens"] for r in records) == m["new_tokens"], name
        assert sum(r["verifier_forwards"] for r in records) == m["verifier_forwards"], name
        assert sum(r["drafter_forwards"] for r in records) == m["drafter_forwards"], name
        assert sum(r["wall_s"] for r in records) == pytest.approx(m["wall_s"], abs=1e-3), name
        if name in ("ar", *OPAQUE) or m["per_position_acceptance"] is None:
            assert all(r["accepted_lengths"] is None for r in records), name
            expected = (m["new_tokens"] - num_prompts) / m["verifier_forwards"]
        else:
            accepted = [n for r in records for n in r["accepted_lengths"]]
            drafts = [g for r in records for g in r["draft_lengths"]]
            assert len(accepted) == m["verifier_forwards"] == len(drafts), name
            expected = sum(accepted) / len(accepted)  # τ: mean tokens per verifier forward
            for r in filter(lambda r: r["accepted_lengths"], records):
                assert r["tau"] == round(sum(r["accepted_lengths"]) / len(r["accepted_lengths"]), 4), name
                assert all(1 <= n <= g + 1 for n, g in zip(r["accepted_lengths"], r["draft_lengths"])), name
            # the sample size of α_i: every draft reaches position 1; fewer reach each later one
            reached = m["per_position_reached"]
            assert len(reached) == len(m["per_position_acceptance"]) and reached[0] == sum(g > 0 for g in drafts)
            assert all(a >= b for a, b in zip(reached, reached[1:])), name
            assert [a is None for a in m["per_position_acceptance"]] == [n == 0 for n in reached], name
        assert m["tau"] == pytest.approx(expected, abs=1e-4), name


@pytest.mark.slow
def test_records_agree_with_the_aggregates_and_versions_are_recorded(toy_family, evaluated):
    _, result = evaluated
    assert result["schema_version"] == 4
    ids = tiny_test_ids(toy_family[0], 2)
    check_records(result["methods"], ids)
    check_records(result["sampling"]["methods"], ids)
    meta = result["meta"]
    from importlib.metadata import version

    import datasets
    import transformers

    assert meta["versions"]["torch"] == torch.__version__ and meta["versions"]["transformers"] == transformers.__version__
    assert meta["versions"]["datasets"] == datasets.__version__
    assert meta["versions"]["align-drafters"] == version("align-drafters")
    assert "deepspeed" in meta["versions"] and meta["versions"]["python"]
    machine = meta["machine"]
    # the keys eval.json schema 1 had stay (the model card reads processor), and the CPU is named
    assert {"platform", "processor", "cpus", "torch_threads", "device", "dtype"} <= set(machine)
    assert machine["cpu_model"] and machine["gpu"] is None and machine["torch_threads"] == torch.get_num_threads()
    assert machine["cpu_model"] in (out := evaluated[0] / "report.md").read_text() and "torch " in out.read_text()


def run_refused(args, capsys):
    capsys.readouterr()  # drop what the test itself printed
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.slow
def test_a_sampled_run_that_fails_keeps_the_greedy_one(toy_family, tmp_path, capsys, monkeypatch):
    """A sampled run that raises after the greedy run has finished (it was a temperature of 1e-300, whose
    probabilities overflowed; such temperatures and non-finite weights are now refused before any work, so a draw
    that fails stands in for what is left) lost the greedy results with it (issue 35). They are written, and the
    failure is one line, exit code 1."""
    def fails(*args, **kwargs):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")

    monkeypatch.setattr(torch, "multinomial", fails)  # drawn from at temperature > 0 only
    root, _ = toy_family
    out = tmp_path / "eval"
    code = main(eval_args(root, out, "eval.methods=[specdiff]", "eval.sampling_temperature=0.7"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("align eval: error: the temperature 0.7 run stopped (")
    assert err[-1].endswith("; eval.json holds the greedy run")
    result = json.loads((out / "eval.json").read_text())
    assert result["methods"]["specdiff"]["exact_match"] == 1.0 and "sampling" not in result


def test_prompt_longer_than_the_context_is_refused(toy_family, tmp_path, capsys):
    root, _ = toy_family
    err = run_refused(eval_args(root, tmp_path / "out", "decode.max_new_tokens=1020"), capsys)
    assert "exceeds the model's context of 1024" in err
    assert not (tmp_path / "out").exists()


def test_empty_prompt_file_is_refused(toy_family, tmp_path, capsys):
    root, _ = toy_family
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    err = run_refused(eval_args(root, tmp_path / "out", f"eval.prompts={empty}"), capsys)
    assert "holds no prompts" in err


def test_prompt_file_without_the_field_is_refused(toy_family, tmp_path, capsys):
    root, _ = toy_family
    other = tmp_path / "q.jsonl"
    other.write_text('{"question": "what?"}\n')
    assert "has no 'prompt' field" in run_refused(eval_args(root, tmp_path / "out", f"eval.prompts={other}"), capsys)
    # ... and naming the field makes it work as a prompt source.
    assert main(eval_args(root, tmp_path / "ok", f"eval.prompts={other}", "eval.prompt_column=question",
                          "eval.methods=[specdiff]", "eval.sampling_temperature=0")) == 0


def test_drafter_with_another_vocabulary_is_refused(toy_family, tmp_path, capsys):
    root, _ = toy_family
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    config.drafter_spec = {"mask_token_id": 2, "logits_shift": 0, "attention": "block_causal"}
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "other")
    err = run_refused(eval_args(root, tmp_path / "out", f"drafter.path={tmp_path / 'other'}"), capsys)
    assert "drafter.path: vocabulary size 300 differs from the verifier's 512" in err
    # The same drafter among eval.compare_drafters is refused the same way, naming its label.
    err = run_refused(eval_args(root, tmp_path / "out", f"eval.compare_drafters={{other: {tmp_path / 'other'}}}"),
                      capsys)
    assert "eval.compare_drafters.other: vocabulary size 300 differs" in err


@pytest.mark.slow
def test_compared_drafters_run_in_the_same_interleaved_run(toy_family, tmp_path):
    """A drafter compared under a label is decoded like drafter.path: the same drafter gives the same τ; a randomly
    re-initialised one is still lossless."""
    root, _ = toy_family
    base = root / "ck" / "drafter-base"
    config = LlamaConfig.from_pretrained(base)
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "random")
    out = tmp_path / "out"
    assert main(eval_args(root, out, "eval.methods=[specdiff,specdiff_cps]", "eval.sampling_temperature=0",
                          f"eval.compare_drafters={{same: {base}, random: {tmp_path / 'random'}}}")) == 0
    result = json.loads((out / "eval.json").read_text())
    methods = result["methods"]
    assert list(methods) == ["ar", "hf_generate", "specdiff", "specdiff_cps", "specdiff@same", "specdiff_cps@same",
                             "specdiff@random", "specdiff_cps@random"]
    assert all(m["exact_match"] == 1.0 for m in methods.values())
    for name in ("specdiff", "specdiff_cps"):
        assert methods[f"{name}@same"]["tau"] == methods[name]["tau"]
        assert methods[f"{name}@same"]["per_position_acceptance"] == methods[name]["per_position_acceptance"]
    assert result["meta"]["compare_drafters"] == {"same": str(base), "random": str(tmp_path / "random")}
    assert "| specdiff@random |" in (out / "report.md").read_text()
    # One colour per drafter in the plots: the methods of each drafter form a group, the baselines none.
    groups = drafter_groups(result)
    assert groups == {"ar": None, "hf_generate": None, "specdiff": "drafter-base (drafter.path)",
                      "specdiff_cps": "drafter-base (drafter.path)", "specdiff@same": "same",
                      "specdiff_cps@same": "same", "specdiff@random": "random", "specdiff_cps@random": "random"}
    assert all((out / plot).stat().st_size > 1000 for plot in ("tau.png", "speedup.png", "acceptance.png"))
    check_records(methods, tiny_test_ids(root, 2))


def test_cps_proxy_fitted_on_the_verifier_trajectories(toy_trajectories, tmp_path, capsys):
    root, trajectories = toy_trajectories
    data_dir = tmp_path / "data"
    shutil.copytree(root / "data", data_dir)  # its own trigram cache, so that the check below sees this run's only
    shutil.rmtree(data_dir / "trigram", ignore_errors=True)
    args = eval_args(root, tmp_path / "out", "eval.methods=[specdiff_cps]", "eval.sampling_temperature=0",
                     f"decode.cps_proxy_corpus={trajectories}", f"data.dir={data_dir}")
    assert main(args) == 0
    result = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert result["methods"]["specdiff_cps"]["exact_match"] == 1.0
    [cache] = [p for p in (data_dir / "trigram").iterdir() if p.is_dir()]  # (beside trigram/'s own marker)
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["source"] == str(trajectories) and manifest["tokens"] > 0
    # A proxy source that is neither a JSONL file nor a trajectories folder is refused before any work.
    err = run_refused(eval_args(root, tmp_path / "bad", "eval.methods=[specdiff_cps]",
                                f"decode.cps_proxy_corpus={tmp_path}"), capsys)
    assert "decode.cps_proxy_corpus:" in err and "neither a JSONL file nor a trajectories folder" in err
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_dllm_eval_records_and_versions(toy_family, tmp_path):
    """eval.mode=dllm's eval.json (schema 2): per-prompt records that add up to each method's sums, versions, machine."""
    root, _ = toy_family
    common = [f"drafter.path={root / 'ck' / 'drafter-base'}", f"data.dir={root / 'data'}", "calibrate.block_length=8",
              "decode.max_new_tokens=8"]
    assert main(["calibrate", "recipes/tiny/spiffy.yaml", *common, f"calibrate.out={tmp_path}", "calibrate.num_prompts=2",
                 "calibrate.budget=2"]) == 0
    out = tmp_path / "eval"
    assert main(["eval", "recipes/tiny/spiffy.yaml", *common, f"calibrate.graph={tmp_path / 'draft_graph.json'}",
                 f"eval.out={out}", "eval.num_prompts=2", "eval.warmup=0", "eval.spiffy_budgets=[2]"]) == 0
    result = json.loads((out / "eval.json").read_text())
    assert result["schema_version"] == 2
    for name, m in result["methods"].items():
        records = m["records"]
        assert [(r["index"], r["id"]) for r in records] == list(enumerate(tiny_test_ids(root, 2)))
        for field in ("nfe", "new_tokens", "accepted_drafts"):
            assert sum(r[field] for r in records) == m[field], (name, field)
        assert sum(r["wall_s"] for r in records) == pytest.approx(m["wall_s"], abs=1e-3)
    assert result["meta"]["versions"]["torch"] == torch.__version__
    assert result["meta"]["machine"]["cpu_model"] and result["meta"]["machine"]["gpu"] is None
    assert f"torch {torch.__version__}" in (out / "report.md").read_text()
