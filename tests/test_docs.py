"""The README and docs/: every command they show in a ```bash block still parses, and every relative link resolves.

A bash block runs under bash with a PATH that holds no program, so nothing starts: every command bash would run
lands in `command_not_found_handle`, which records its words after bash's own expansion (variables, arrays, quotes,
line continuations). Each recorded command is then checked without doing its work:

- `align <stage> recipe.yaml [key=value ...]` (also `python -m align`, `python align/train.py`, `deepspeed ...
  align/train.py`, and the launch scripts that pass their arguments to a stage): parsed by the stage's own parser and
  its recipe and overrides validated as `align validate` does (`load_recipe`: every key and type). Models, prompt
  files and output folders are not checked, so placeholders (`DIR`, `../shared/benchmarks/...`) pass;
- `align <tool> ...` and `align <stage> --help`: parsed;
- `bash launch/x.sh` (or experiments/x.sh), `sbatch launch/x.sbatch`: the script exists and `bash -n` parses it;
- `python file.py`, `python -m module`: the file or module exists;
- a few other programs (pip, trackio) are allowed as they are; any other command fails the test, so a new kind of
  command gets a check here.

Links: every `[text](target)` outside code resolves to a file or folder of the checkout, and every `#anchor` to a
heading of its page (GitHub's slugs).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from align.cli import STAGES, TOOLS, build_parser
from align.config import RecipeError
from align.recipe_files import get_key, load_recipe

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
README_MAX_LINES = 250

# launch scripts whose arguments are a stage's: script -> (stage, the recipe it runs, or None when the first argument
# is the recipe)
LAUNCH_STAGES = {
    "experiments/tiny_align.sh": ("train", "recipes/tiny/align.yaml"),
    "experiments/tiny_dflash.sh": ("train", "recipes/tiny/dflash.yaml"),
    "launch/single_node.sh": ("train", None),
    "launch/multi_node.sh": ("train", None),
    "launch/slurm.sbatch": ("train", None),
}
# programs a block may show that have nothing of align's to check
OTHER_PROGRAMS = {"pip", "trackio"}

PARSER, STAGE_PARSERS = build_parser()


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --------------------------------------------------------------------------------------------------------------------
# reading markdown
# --------------------------------------------------------------------------------------------------------------------
def fenced_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number, language, code) of every fenced block, indented ones (in lists) included, dedented."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        opening = re.match(r"^(\s*)```\s*([\w+-]*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        indent, language, start, body = len(opening.group(1)), opening.group(2), i + 1, []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        blocks.append((start, language, "\n".join(body) + "\n"))
        i += 1
    return blocks


def prose(text: str, code_spans: bool = False) -> str:
    """The text outside fenced blocks, and outside inline code spans (where brackets are not links) unless
    `code_spans`."""
    outside, fenced = [], False
    for line in text.split("\n"):
        if re.match(r"^\s*```", line):
            fenced = not fenced
            continue
        outside.append("" if fenced else line if code_spans else re.sub(r"`[^`]*`", "", line))
    return "\n".join(outside)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, digits, _ and - kept), spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link's text only
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    for line in prose(page.read_text(), code_spans=True).split("\n"):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            n = seen.get(base, 0)
            found.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return found


def links(page: Path) -> list[str]:
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose(page.read_text()))


# --------------------------------------------------------------------------------------------------------------------
# running a bash block with nothing to run
# --------------------------------------------------------------------------------------------------------------------
RECORDER = r"""
set -u
command_not_found_handle() { printf '%s\0' "$#" "$@" >> "$ALIGN_DOCS_RECORD"; return 0; }
PATH="$ALIGN_DOCS_EMPTY"
"""


def commands(code: str, tmp: Path) -> list[list[str]]:
    """The commands a bash block runs, each as the words bash would pass to it."""
    syntax = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True)
    assert syntax.returncode == 0, f"bash cannot parse it: {syntax.stderr.strip()}"
    record, empty = tmp / "record", tmp / "empty"
    empty.mkdir(exist_ok=True)
    record.write_bytes(b"")
    done = subprocess.run(["/bin/bash", "-c", RECORDER + code], cwd=tmp, capture_output=True, text=True, timeout=30,
                          env={"ALIGN_DOCS_RECORD": str(record), "ALIGN_DOCS_EMPTY": str(empty), "HOME": str(tmp)})
    assert done.returncode == 0 and not done.stderr, f"bash could not expand it: {done.stderr.strip()}"
    words, found = record.read_bytes().split(b"\0")[:-1], []
    while words:
        n = int(words[0])
        found.append([w.decode() for w in words[1:n + 1]])
        words = words[n + 1:]
    return found


# --------------------------------------------------------------------------------------------------------------------
# checking one command
# --------------------------------------------------------------------------------------------------------------------
def check_align(args: list[str]) -> None:
    """`align ARGS` parses, and a stage's recipe and overrides validate (as `align validate` does)."""
    assert args, "align without a stage"
    name = args[0]
    assert name in STAGES or name in TOOLS, f"align has no stage or tool {name!r}"
    if name in TOOLS or args[1:] in (["--help"], ["-h"]):
        if name in TOOLS:
            try:
                PARSER.parse_args(args)
            except SystemExit as e:
                raise AssertionError(f"align {name}: its arguments do not parse") from e
        return
    try:
        parsed = STAGE_PARSERS[name].parse_intermixed_args(args[1:])
    except SystemExit as e:
        raise AssertionError(f"align {name}: its arguments do not parse") from e
    recipe_file = ROOT / parsed.recipe
    assert recipe_file.is_file(), f"align {name}: no recipe {parsed.recipe}"
    overrides = list(parsed.overrides) + [f"{key}={getattr(parsed, key)}" for _, key in STAGES[name].flags
                                          if getattr(parsed, key) is not None]
    try:
        recipe = load_recipe(str(recipe_file), overrides)
        if getattr(parsed, "get", None):
            get_key(recipe, parsed.get)
    except RecipeError as e:
        raise AssertionError(f"align {name}: {e}") from e


def check_script(words: list[str]) -> None:
    """`bash|sbatch [options] SCRIPT ARGS`: the script exists and parses; a stage's arguments validate."""
    at = next((i for i, w in enumerate(words) if w.endswith((".sh", ".sbatch"))), None)
    assert at is not None, "no script named"
    script = ROOT / words[at]
    assert script.is_file(), f"no script {words[at]}"
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, f"{words[at]} does not parse: {syntax.stderr.strip()}"
    rest = words[at + 1:]
    if words[at] == "launch/align.sh":
        check_align(rest)
    elif words[at] in LAUNCH_STAGES:
        stage, recipe = LAUNCH_STAGES[words[at]]
        check_align([stage, *([recipe] if recipe else []), *rest])
    else:
        for word in rest:
            assert not word.endswith(".yaml") or (ROOT / word).is_file(), f"no recipe {word}"


def check_command(words: list[str]) -> None:
    program = words[0]
    if program == "align":
        check_align(words[1:])
    elif program in ("python", "python3"):
        if words[1:2] == ["-m"]:
            module = words[2]
            if module == "align":
                check_align(words[3:])
            else:
                assert importlib.util.find_spec(module) is not None, f"no module {module}"
        elif words[1:2] != ["-c"]:
            assert (ROOT / words[1]).is_file(), f"no file {words[1]}"
            if words[1] == "align/train.py":
                check_align(["train", *words[2:]])
    elif program == "deepspeed":
        script = next((w for w in words if w.endswith(".py")), None)
        assert script and (ROOT / script).is_file(), f"deepspeed runs no file of the checkout: {words}"
        if script == "align/train.py":
            check_align(["train", *words[words.index(script) + 1:]])
    elif program in ("bash", "sbatch"):
        check_script(words[1:])
    else:
        assert program in OTHER_PROGRAMS, f"a command this test does not know how to check: {program!r}"


def bash_blocks() -> list[tuple[str, str]]:
    return [(f"{rel(page)}:{line}", code) for page in PAGES
            for line, language, code in fenced_blocks(page.read_text()) if language in ("bash", "sh", "shell")]


# --------------------------------------------------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where,code", bash_blocks(), ids=[where for where, _ in bash_blocks()])
def test_every_command_shown_parses(where, code, tmp_path):
    shown = commands(code, tmp_path)
    assert shown, "the block runs no command"
    for words in shown:
        try:
            check_command(words)
        except AssertionError as e:
            raise AssertionError(f"{where}: {' '.join(words)}\n  {e}") from None


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_python_block_compiles(page):
    for line, language, code in fenced_blocks(page.read_text()):
        if language == "python":
            compile(code, f"{rel(page)}:{line}", "exec")


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked)):
            broken.append(f"{target}: no heading #{anchor} in {rel(linked)}")
    assert not broken, f"{rel(page)}: " + "; ".join(broken)


def test_every_page_is_linked_from_its_index():
    docs = ROOT / "docs"
    for index, pages in ((docs / "README.md", docs.glob("*.md")), (docs / "results" / "README.md",
                                                                     (docs / "results").glob("*.md"))):
        linked = {(index.parent / target.partition("#")[0]).resolve() for target in links(index)}
        missing = [rel(p) for p in pages if p != index and p.resolve() not in linked]
        assert not missing, f"{rel(index)} does not link {missing}"


def test_docs_pages_named_in_code_and_recipes_exist():
    """Comments point to docs/ for numbers and details: the pages they name are there."""
    patterns = ("align/**/*.py", "recipes/**/*.yaml", "launch/*", "experiments/*", "tests/*.py")
    named = [(rel(f), page) for pattern in patterns
             for f in sorted(ROOT.glob(pattern)) if f.is_file()
             for page in re.findall(r"docs/[\w./*-]+\.md", f.read_text())]
    assert named, "no file names a docs page"
    missing = [(where, page) for where, page in named if not list(ROOT.glob(page))]
    assert not missing, f"pages named but missing: {missing}"


def test_the_tiny_familys_parameter_counts_are_its_manifests():
    """docs/models.md's table of the shipped tiny family says what each part's manifest.json records (it said 3.5M
    for 5,310,720: issue 36)."""
    import json

    table = (ROOT / "docs" / "models.md").read_text()
    for part in ("verifier", "drafter-base", "ar-drafter"):
        manifest = json.loads((ROOT / "checkpoints" / "tiny" / part / "manifest.json").read_text())
        shown = re.search(rf"^\| `{part}` \|.*\| ([\d.]+)M \|$", table, re.M)
        assert shown and float(shown.group(1)) == round(manifest["parameters"] / 1e6, 1), part


def test_the_readme_stays_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move the detail to docs/"


def test_the_checks_catch_what_they_should(tmp_path):
    """A stale key, a missing script and a broken anchor are caught (the checks above are not vacuous)."""
    with pytest.raises(AssertionError, match="unknown key"):
        check_align(["eval", "recipes/tiny/eval.yaml", "decode.gama=12"])
    with pytest.raises(AssertionError, match="no script"):
        check_command(["bash", "launch/no_such_script.sh"])
    with pytest.raises(AssertionError, match="does not know"):
        check_command(["rm", "-rf", "checkpoints"])
    assert commands('O=(a "b c")\nalign eval "${O[@]}" x=$((1 + 1))\n', tmp_path) == [["align", "eval", "a", "b c",
                                                                                          "x=2"]]
    assert slug("What `eval.json` holds") == "what-evaljson-holds"
    assert slug("Drafting at temperature > 0") == "drafting-at-temperature--0"
