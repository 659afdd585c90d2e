"""The layout rules of DESIGN §2, checked on the source: stages never import stages, building blocks never import
stages, the runtime never imports training code, one module renames into place, launch scripts hold no Python."""

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "align"
# Modules with a main(recipe, command) that `align <stage>` runs (train.py is also the DeepSpeed launcher's script).
# cli.py, which dispatches to them, and __main__.py sit above them.
STAGES = {"bootstrap", "trajectories", "train", "calibrate", "evaluate", "evaluate_dllm", "export", "gkd", "serve_check",
          "convert", "prompts"}
ENTRY_POINTS = {"cli", "__main__"}
TRAINING_CODE = {"deepspeed", "align.train", "align.windows", "align.losses", "peft", "trl"}


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


def test_every_stage_has_a_main_and_is_known():
    for name in STAGES:
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), name


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_module_below_the_cli_imports_a_stage(name):
    short = name.removeprefix("align.")
    if short in ENTRY_POINTS:
        return
    stage_imports = {m for m in imports(modules()[name]) if m.removeprefix("align.") in STAGES} - {name}
    assert not stage_imports, f"{name} imports the stage(s) {sorted(stage_imports)}: move what it needs into a " \
                              "building block"


@pytest.mark.parametrize("name", sorted(n for n in modules() if n.startswith("align.decoding")))
def test_the_runtime_never_imports_training_code(name):
    found = {m for m in imports(modules()[name]) if m.split(".")[0] in TRAINING_CODE or m in TRAINING_CODE}
    assert not found, f"{name} imports {sorted(found)}"


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


def test_only_checkpoint_renames_into_place():
    offenders = {name: renames(path) for name, path in modules().items() if name != "align.checkpoint"}
    assert not {name: lines for name, lines in offenders.items() if lines}, \
        "write through align.checkpoint (atomic_file, atomic_folder, publish_folder)"
    assert renames(PACKAGE / "checkpoint.py")  # the scan does see renames


# Python given inline (-c, a heredoc or stdin) or YAML read by hand: logic that belongs in an align command.
EMBEDDED = re.compile(r"python3?\s+(-c\b|-\s)|<<-?\s*'?PY|safe_load|import yaml")


def test_launch_scripts_call_align_commands_only():
    for script in sorted((ROOT / "launch").iterdir()):
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
