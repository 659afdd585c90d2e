"""The layout rules of DESIGN §2, checked on the source: the stages live in align/stages/ and never import each
other, building blocks never import stages, preflight imports nothing above it, the runtime never imports training
code, no two modules import each other (not even inside functions), one module renames into place, launch scripts hold
no Python."""

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from align.stages import stage_modules

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "align"
# Modules with a main(recipe, command) that `align <stage>` runs, from the one list of stages
# (align/stages/__init__.py): align.stages.<name>, a module or a package whose own modules are parts of that one stage.
STAGES = stage_modules()
# cli.py dispatches to the stages, align/stages/__init__.py names them, __main__.py runs the CLI, and align/train.py is
# the script `deepspeed align/train.py` runs (the CLI again): they sit above the stages.
ENTRY_POINTS = {"align.cli", "align.stages", "align.stages.__init__", "align.__main__", "align.train"}
TRAINING_CODE = {"deepspeed", "align.stages.train", "align.windows", "align.losses", "peft", "trl"}
# What preflight (the checks every stage's refusals are built from) may import from align: the schema (its field
# types, and reading a recipe's keys), the model families, the Hub's address book, the nothing-is-lost layer
# (checksums of folders align wrote), and the DFlash drafter's modules (the model and its speculators format), whose
# import registers its config with transformers' AutoConfig (reading a DFlash config.json), and the remote-code shims, which must be in place before the
# first config of a model that ships its own code is read.
BELOW_PREFLIGHT = {"align.config", "align.recipe_fields", "align.recipe_files", "align.drafters.spec", "align.hub",
                   "align.disk", "align.drafters.dflash", "align.drafters.speculators_format",
                   "align.remote_code"}


def modules() -> dict[str, Path]:
    """Dotted name (align.x, align.decoding.y) -> file."""
    return {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in PACKAGE.rglob("*.py")}


def imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def stage_of(name: str) -> str | None:
    """The stage a module is (or is a part of), or None for a building block."""
    return next((stage for stage in STAGES if name == stage or name.startswith(stage + ".")), None)


def test_every_stage_has_a_main_and_is_known():
    assert {"align.stages.bootstrap", "align.stages.train", "align.stages.evaluate", "align.stages.export"} <= STAGES
    for name in STAGES:
        assert name.startswith("align.stages."), f"{name}: a stage lives in align/stages/"
        tree = ast.parse(Path(importlib.util.find_spec(name).origin).read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), name


def test_every_module_in_align_stages_is_a_stage():
    # align/stages/ holds the stages and their parts only: a building block there would look like a stage.
    strays = [name for name in modules() if name.startswith("align.stages.") and name != "align.stages.__init__"
              and stage_of(name.removesuffix(".__init__")) is None]
    assert not strays, f"{strays} are in align/stages/ but no stage of align/stages/__init__.py"


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_module_imports_another_stage(name):
    # A stage imports no other stage; a building block imports none (what two stages share is a building block).
    short = name.removesuffix(".__init__")
    if short in ENTRY_POINTS:
        return
    own = stage_of(short)
    stage_imports = {m for m in imports(modules()[name]) if stage_of(m) not in (None, own)}
    assert not stage_imports, f"{name} imports the stage(s) {sorted(stage_imports)}: move what it needs into a " \
                              "building block"


def test_preflight_imports_nothing_above_it():
    found = {m for m in imports(PACKAGE / "preflight.py") if m.split(".")[0] == "align"}
    above = {m for m in found if not any(m == b or m.startswith(b + ".") for b in BELOW_PREFLIGHT)}
    assert not above, f"align.preflight imports {sorted(above)}: a check that needs them belongs to its stage"


@pytest.mark.parametrize("name", sorted(n for n in modules() if n.startswith("align.decoding")))
def test_the_runtime_never_imports_training_code(name):
    found = {m for m in imports(modules()[name]) if m.split(".")[0] in TRAINING_CODE or m in TRAINING_CODE}
    assert not found, f"{name} imports {sorted(found)}"


# The drafter kinds' own modules: the DFlash model and its speculators format, the three adapters, loading and noise. The runtime reaches a drafter
# through align.drafters (drafter_for) and its interface (align.drafters.base) only.
DRAFTER_KIND_MODULES = {"align.drafters.dflash", "align.drafters.speculators_format", "align.drafters.masked",
                        "align.drafters.canvas", "align.drafters.conditioned", "align.drafters.loading", "align.drafters.noise"}


@pytest.mark.parametrize("name", sorted(n for n in modules() if n.startswith("align.decoding")))
def test_the_runtime_imports_no_drafter_kind(name):
    found = {m for m in imports(modules()[name]) if any(m == k or m.startswith(k + ".") for k in DRAFTER_KIND_MODULES)}
    assert not found, f"{name} imports {sorted(found)}: ask the Drafter (align.drafters.drafter_for) instead"


def import_graph() -> dict[str, set[tuple[str, bool]]]:
    """align's modules -> the align modules each imports, with whether the import is inside a function (run on call,
    after every module has loaded) rather than at import time (the top level, if/try blocks, class bodies; not an
    `if __name__ == "__main__":` block, which runs only when the file is a script and so not this module).
    `from align.x import y` is an edge to align.x.y when that is a module, else to align.x; an import of a package
    that holds the importer (`from align import __version__`) is none: Python initialises parents first."""
    mods = {name.removesuffix(".__init__"): path for name, path in modules().items()}
    graph: dict[str, set[tuple[str, bool]]] = {}
    for name, path in mods.items():
        parents = {".".join(name.split(".")[:k]) for k in range(1, name.count(".") + 1)}
        edges: set[tuple[str, bool]] = set()

        def visit(node: ast.AST, local: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and ast.unparse(child.test) in ("__name__ == '__main__'",):
                    continue  # runs only as a script (`deepspeed align/train.py`), where the file is __main__
                inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, ast.Import):
                    edges.update((alias.name, inner) for alias in child.names)
                elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                    edges.update((f"{child.module}.{alias.name}" if f"{child.module}.{alias.name}" in mods
                                  else child.module, inner) for alias in child.names)
                visit(child, inner)

        visit(ast.parse(path.read_text()), False)
        graph[name] = {(target, local) for target, local in edges if target in mods and target not in parents | {name}}
    return graph


def circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of `graph` (module -> modules it imports), as the modules along it; [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(name: str) -> list[str]:
        state[name] = 1
        path.append(name)
        for target in sorted(graph.get(name, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := walk(target)):
                return found
        state[name] = 2
        path.pop()
        return []

    for name in sorted(graph):
        if name not in state and (found := walk(name)):
            return found
    return []


def test_no_import_circles():
    # Not even through a function-local import: a circle there is a module that needs to know its caller.
    every = {name: {target for target, _ in edges} for name, edges in import_graph().items()}
    assert not circle(every), f"an import circle: {' -> '.join(circle(every))}"


def test_the_circle_check_sees_a_circle():
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_every_module_imports():
    # The fast tier (-m "not slow") reaches every module at least this far: each imports on its own, in this process.
    import importlib

    left_out = {"align.__main__", "align.vllm_worker"}  # runs the CLI; imports vllm, which only .venv-vllm has
    for name in sorted(set(modules()) - left_out):
        importlib.import_module(name.removesuffix(".__init__"))


def renames(path: Path) -> list[int]:
    """Lines that rename a file or folder: os.replace/os.rename/shutil.move, Path.rename, Path.replace(target).
    (str.replace takes two arguments, Path.replace one.)"""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        attr, owner = node.func.attr, node.func.value
        named = owner.id if isinstance(owner, ast.Name) else None
        if (attr in ("replace", "rename") and named == "os") or (attr == "move" and named == "shutil") or \
                attr == "rename" or (attr == "replace" and len(node.args) == 1 and not node.keywords):
            lines.append(node.lineno)
    return lines


def test_only_disk_renames_into_place():
    offenders = {name: renames(path) for name, path in modules().items() if name != "align.disk"}
    assert not {name: lines for name, lines in offenders.items() if lines}, \
        "write through align.disk (atomic_file, atomic_folder, publish_folder)"
    assert renames(PACKAGE / "disk.py")  # the scan does see renames


# Python given inline (-c, a heredoc or stdin) or YAML read by hand: logic that belongs in an align command.
EMBEDDED = re.compile(r"python3?\s+(-c\b|-\s)|<<-?\s*'?PY|safe_load|import yaml")


def test_launch_scripts_call_align_commands_only():
    scripts = [*(ROOT / "launch").iterdir(), *(ROOT / "experiments").iterdir()]
    for script in sorted(path for path in scripts if path.is_file()):  # not a __pycache__ folder
        found = EMBEDDED.search(script.read_text())
        assert not found, f"{script.name} embeds Python or parses YAML ({found.group(0)!r}): add an align command"


def test_the_vllm_worker_imports_only_vllm_and_the_stdlib():
    # It runs under .venv-vllm's python, which has vllm and its own transformers, and no align or torch of align's.
    found = {m.split(".")[0] for m in imports(PACKAGE / "vllm_worker.py")}
    assert found <= set(sys.stdlib_module_names) | {"vllm"}, sorted(found - set(sys.stdlib_module_names))


def test_only_the_vllm_worker_imports_vllm():
    # align's environment has no vllm: the rest of align reaches it through align/vllm_engine.py's worker.
    offenders = [name for name, path in modules().items()
                 if name != "align.vllm_worker" and any(m.split(".")[0] == "vllm" for m in imports(path))]
    assert not offenders, offenders


# Reads of the drafter's kind (issue 23): its spec's kind or attention, the canvas-decoder test, the DFlash tap, and
# whether the recipe builds a new DFlash drafter (its `dflash` section set or not, in any form: issue 51 asks that of
# align/drafters/kind.py's TrainedDrafter). They belong in align/drafters/, whose `drafter_for` picks an
# implementation once; convert.py and weights.py read a GGUF
# tensor's `source.kind`, no drafter's. What is left outside: the kind handed to spec.method_refusal (the one
# refusal of a method a kind does not run) by the eval stage and the Python API, serve_check's refusal message, and
# the memory probe's window shapes (a block-causal drafter reads all of a row's windows in one sequence, as the window
# builders lay them out).
KIND_READS = re.compile(r"spec\.kind|\.kind ==|\.kind in|attention ==|is_canvas_decoder|dflash_tap|\.tap\b|"
                        r"\.dflash is (not )?None|\.dflash (and|or)\b|(not|if) [\w.]*\.dflash\b")
MOST_KIND_READS_OUTSIDE_DRAFTERS = 4


def kind_reads(path: Path) -> list[int]:
    return [number for number, line in enumerate(path.read_text().splitlines(), 1) if KIND_READS.search(line)]


def test_the_drafter_kind_is_read_in_align_drafters():
    outside = {name: lines for name, path in modules().items()
               if not name.startswith("align.drafters") and name not in ("align.stages.convert", "align.weights")
               and (lines := kind_reads(path))}
    count = sum(len(lines) for lines in outside.values())
    assert count <= MOST_KIND_READS_OUTSIDE_DRAFTERS, \
        f"{count} reads of the drafter kind outside align/drafters/ ({outside}): ask the Drafter (drafter_for) instead"
    assert kind_reads(PACKAGE / "drafters" / "__init__.py")  # the scan does see the factory's


def test_a_window_loss_without_a_function_is_refused():
    # config.LOSSES declares each loss once with what it reads; losses.py finds its function by that name.
    from align import losses

    assert {name: reads for name, (_, reads) in losses.WINDOW_LOSSES.items()} == \
        {name: declared.reads for name, declared in losses.LOSSES.items()}
    # ... and how it is normalised: the function takes that count (num_windows or num_tokens) and not the other.
    import inspect

    for name, (function, _) in losses.WINDOW_LOSSES.items():
        keyword = next(iter(losses.normalisation(name, 1, 1)))
        assert {keyword} == set(inspect.signature(function).parameters) & {"num_windows", "num_tokens"}, name
    with pytest.raises(ImportError, match="no function of that name"):
        losses._loss_function("a_loss_declared_without_a_function")


# A module is read as a whole by whoever changes it: past this size it holds more than one concern (stages/train.py
# held five at 1,066 lines: the DeepSpeed config, distributed start-up, the row order, saving and the loop).
MOST_LINES = 800
# Over the cap, to be split next: none today.
LARGER: dict[str, int] = {}


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_module_outgrows_the_cap(name):
    lines = len(modules()[name].read_text().splitlines())
    assert lines <= LARGER.get(name, MOST_LINES), f"{name} is {lines} lines (cap {LARGER.get(name, MOST_LINES)}): " \
                                                  "split it by concern"
