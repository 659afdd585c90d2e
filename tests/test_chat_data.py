"""Prompts from real datasets (JSONL, Parquet, a Hub-layout folder; messages or a prompt column), rendered with the
chat template of the tokenizer that reads them, identically in trajectories, eval and calibration (#12 item 4)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from tokenizers.processors import TemplateProcessing

from align.cli import main
from align.config import RecipeError
from align.data import (chat_template, check_trajectories_match, load_prompts, load_trajectories, render_prompt,
                        template_sha256)
from align.draft_graph import DraftGraph
from align.models import load_tokenizer
from align.recipe_files import load_recipe

from conftest import TOY_TRAJECTORIES

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "checkpoints" / "tiny" / "tokenizer"
# A small chat template of the usual shape: turns with role markers, and an open assistant turn to answer in.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")

CONVERSATIONS = [
    [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"},
     {"role": "assistant", "content": "    return a + b"}],
    [{"role": "user", "content": "sort a list"}, {"role": "assistant", "content": "sorted(x)"},
     {"role": "user", "content": "in place?"}, {"role": "assistant", "content": "x.sort()"}],
    [{"role": "user", "content": "def fib(n):"}],
]
# What each conversation leaves as the prompt: everything before its trailing assistant turn.
PROMPTS = [CONVERSATIONS[0][:2], CONVERSATIONS[1][:3], CONVERSATIONS[2]]
TEXTS = ["def add(a, b):", "sort a list", "def fib(n):"]


def with_template(source: Path, dest: Path, template: str = TEMPLATE) -> Path:
    """A copy of a model or tokenizer folder (weights linked) whose tokenizer carries `template`."""
    dest.mkdir(parents=True)
    for f in source.iterdir():
        (dest / f.name).symlink_to(f) if f.name == "model.safetensors" else shutil.copy2(f, dest / f.name)
    (dest / "chat_template.jinja").write_text(template)
    return dest


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """The same prompts in every kind of local source `datasets` reads."""
    from datasets import Dataset

    root = tmp_path_factory.mktemp("sources")
    rows = [{"messages": m, "prompt": t} for m, t in zip(CONVERSATIONS, TEXTS)]
    hub = root / "hub"  # the layout of a Hub dataset repository: data/<split>-<shard>-of-<n>.parquet
    (hub / "data").mkdir(parents=True)
    Dataset.from_list(rows).to_parquet(str(hub / "data" / "train-00000-of-00001.parquet"))
    Dataset.from_list(rows[::-1]).to_parquet(str(hub / "data" / "test-00000-of-00001.parquet"))
    Dataset.from_list(rows).to_parquet(str(root / "prompts.parquet"))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"question": t}) + "\n" for t in TEXTS))
    return {"hub": hub, "parquet": root / "prompts.parquet", "jsonl": root / "prompts.jsonl"}


def prompts_of(*overrides: str, key: str = "data.train_prompts"):
    return load_prompts(load_recipe(None, list(overrides)), key)


# --------------------------------------------------------------------------------------------------------------------
# sources
# --------------------------------------------------------------------------------------------------------------------
def test_every_source_kind_gives_the_same_prompts(sources):
    hub, parquet, jsonl = sources["hub"], sources["parquet"], sources["jsonl"]
    assert prompts_of(f"data.train_prompts={hub}", "data.prompt_column=messages") == PROMPTS
    assert prompts_of(f"data.train_prompts={hub}") == TEXTS  # the default column, `prompt`
    assert prompts_of(f"data.train_prompts={hub}", "data.train_split=test") == TEXTS[::-1]
    assert prompts_of(f"data.train_prompts={parquet}", "data.prompt_column=messages") == PROMPTS
    assert prompts_of(f"data.train_prompts={jsonl}", "data.prompt_column=question") == TEXTS
    # eval and calibration read the same kinds of source, with their own split and column keys
    assert prompts_of(f"eval.prompts={hub}", "eval.split=train", "eval.prompt_column=messages",
                      key="eval.prompts") == PROMPTS
    assert prompts_of(f"calibrate.prompts={parquet}", "calibrate.prompt_column=messages", "calibrate.num_prompts=2",
                      key="calibrate.prompts") == PROMPTS[:2]


def test_a_conversation_is_cut_before_its_trailing_assistant_turns(tmp_path):
    rows = [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "assistant", "content": "c"}],
            [{"role": "user", "content": "d"}, {"role": "assistant", "content": "e"}, {"role": "user", "content": "f"}]]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    assert prompts_of(f"data.train_prompts={path}", "data.prompt_column=messages") == [rows[0][:1], rows[1]]


# --------------------------------------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------------------------------------
def test_plain_prompts_are_tokenized_as_before_without_a_template():
    tokenizer = load_tokenizer(str(TOKENIZER))
    assert chat_template(tokenizer, "auto", str(TOKENIZER)) is None and tokenizer.chat_template is None
    assert render_prompt(tokenizer, "def f(x):", None) == tokenizer("def f(x):", add_special_tokens=False).input_ids
    # A tokenizer that adds a BOS (Gemma's, Llama 3's) keeps it in plain text: those models drift without it.
    bos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    tokenizer._tokenizer.post_processor = TemplateProcessing(single=f"{tokenizer.eos_token} $A",
                                                             special_tokens=[(tokenizer.eos_token, bos)])
    plain = tokenizer("def f(x):", add_special_tokens=False).input_ids
    assert render_prompt(tokenizer, "def f(x):", None) == [bos, *plain]
    with pytest.raises(RecipeError, match="data.chat_template: on, but the tokenizer of .* has no chat template"):
        chat_template(tokenizer, "on", str(TOKENIZER))
    with pytest.raises(RecipeError, match="chat-message prompts need a chat template"):
        render_prompt(tokenizer, PROMPTS[0], None)


def test_rendering_applies_the_template_with_a_generation_prompt(tmp_path):
    tokenizer = load_tokenizer(str(with_template(TOKENIZER, tmp_path / "tok")))
    template = chat_template(tokenizer, "auto", "tok")
    assert template == TEMPLATE and chat_template(tokenizer, "off", "tok") is None
    text = "<|system|>You write Python.\n<|user|>def add(a, b):\n<|assistant|>"
    assert render_prompt(tokenizer, PROMPTS[0], template) == tokenizer(text, add_special_tokens=False).input_ids
    # A plain prompt is one user turn.
    assert render_prompt(tokenizer, "def fib(n):", template) == render_prompt(tokenizer, PROMPTS[2], template)


def test_a_template_that_writes_the_bos_gives_one_bos(tmp_path):
    """The template writes its BOS, and this tokenizer adds one of its own to any text it encodes (as Llama's and
    Gemma's do): rendering must not add the second."""
    from tokenizers import Tokenizer, processors

    folder = with_template(TOKENIZER, tmp_path / "tok", "{{ bos_token }}" + TEMPLATE)
    bos = "<|endoftext|>"
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    raw.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, raw.token_to_id(bos))])
    raw.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": bos}))
    tokenizer = load_tokenizer(str(folder))
    assert tokenizer("x").input_ids[0] == tokenizer.bos_token_id  # the tokenizer does add one by itself
    ids = render_prompt(tokenizer, "def fib(n):", chat_template(tokenizer, "on", "tok"))
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


# --------------------------------------------------------------------------------------------------------------------
# the stages: one rendering everywhere, recorded, and checked by training
# --------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_run(toy_family, sources, tmp_path_factory):
    """Trajectories, eval and calibration of the toy family given a chat template, on the Hub-layout folder's
    conversations."""
    root, _ = toy_family
    out = tmp_path_factory.mktemp("chat")
    verifier = with_template(root / "ck" / "verifier", out / "verifier")
    drafter = with_template(root / "ck" / "drafter-base", out / "drafter")
    common = [f"verifier.path={verifier}", f"drafter.path={drafter}", f"data.dir={root / 'data'}",
              "decode.max_new_tokens=8"]
    hub = sources["hub"]
    assert main(["trajectories", "recipes/tiny/align.yaml", *common, f"trajectories.out={out / 'traj'}",
                 f"data.train_prompts={hub}", "data.prompt_column=messages", "trajectories.batch_size=2",
                 *TOY_TRAJECTORIES]) == 0
    assert main(["eval", "recipes/tiny/eval.yaml", *common, f"ar_drafter.path={root / 'ck' / 'ar-drafter'}",
                 f"eval.out={out / 'eval'}", f"eval.prompts={hub}", "eval.split=train", "eval.prompt_column=messages",
                 "eval.methods=[specdiff]", "eval.sampling_temperature=0", "eval.warmup=0"]) == 0
    assert main(["calibrate", "recipes/tiny/spiffy.yaml", *common, f"calibrate.out={out / 'graph'}",
                 f"calibrate.prompts={hub}", "calibrate.prompt_column=messages", "calibrate.block_length=8",
                 "calibrate.budget=2"]) == 0
    assert main(["eval", "recipes/tiny/spiffy.yaml", *common, f"calibrate.graph={out / 'graph' / 'draft_graph.json'}",
                 "calibrate.block_length=8", f"eval.out={out / 'dllm'}", f"eval.prompts={hub}", "eval.split=train",
                 "eval.prompt_column=messages", "eval.warmup=0", "eval.spiffy_budgets=[2]"]) == 0
    return out, common


@pytest.mark.slow
def test_trajectories_eval_and_calibration_read_the_same_token_ids(chat_run):
    out, _ = chat_run
    tokenizer = load_tokenizer(str(out / "verifier"))
    expected = [render_prompt(tokenizer, p, TEMPLATE) for p in PROMPTS]
    rows = load_trajectories(out / "traj")
    by_prompt = {i: ids for i, ids in zip(rows["prompt_index"], rows["prompt_ids"])}
    assert [by_prompt[i] for i in range(len(PROMPTS))] == expected
    conversation = "<|user|>sort a list\n<|assistant|>sorted(x)\n<|user|>in place?\n<|assistant|>"
    assert tokenizer.decode(expected[1]) == conversation
    settings = json.loads((out / "traj" / "manifest.json").read_text())["settings"]
    meta = json.loads((out / "eval" / "eval.json").read_text())["meta"]
    graph = DraftGraph.load(out / "graph" / "draft_graph.json", block_length=8).meta
    dllm = json.loads((out / "dllm" / "eval.json").read_text())["meta"]
    records = [settings, meta, graph, dllm]  # trajectories, eval, calibration, eval of the dLLM alone
    digest = hashlib.sha256(json.dumps(expected).encode()).hexdigest()
    assert [r["prompts_sha256"] for r in records] == [digest] * 4
    template = hashlib.sha256(TEMPLATE.encode()).hexdigest()
    assert [r["chat_template_sha256"] for r in records] == [template] * 4


def test_training_refuses_trajectories_of_another_template(chat_run, capsys):
    out, common = chat_run
    recipe_args = [*common, f"trajectories.out={out / 'traj'}", *TOY_TRAJECTORIES]
    manifest = json.loads((out / "traj" / "manifest.json").read_text())
    check_trajectories_match(load_recipe("recipes/tiny/align.yaml", recipe_args), manifest)  # the same: accepted
    capsys.readouterr()
    assert main(["train", "recipes/tiny/align.yaml", *recipe_args, "data.chat_template=off",
                 f"train.out={out / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("align train: error: data.chat_template: ") and err.count("\n") == 1, err
    assert f"rendered with the chat template sha256 {template_sha256(TEMPLATE)[:12]}" in err
    assert not (out / "run").exists()
    # Trajectories made before templates existed (no hash in the manifest) rendered none.
    del manifest["settings"]["chat_template_sha256"]
    with pytest.raises(RecipeError, match="rendered with no chat template"):
        check_trajectories_match(load_recipe("recipes/tiny/align.yaml", recipe_args), manifest)


def test_yaml_on_and_off_are_the_words_not_booleans(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  chat_template: off\n")  # YAML 1.1 reads a bare off as false
    assert load_recipe(recipe).data.chat_template == "off"
    assert load_recipe(None, ["data.chat_template=on"]).data.chat_template == "on"
    with pytest.raises(RecipeError, match="data.chat_template: "):
        load_recipe(None, ["data.chat_template=always"])
