"""Reading a recipe file: strict YAML (a key given twice is refused), `key.sub=value` overrides applied to the parsed
YAML before validation (so a YAML value and a command-line value go through the same checks), and pydantic's errors
as one line naming the key. The schema itself, with every default, is align/config.py.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from align.config import Recipe, RecipeError
from align.recipe_fields import Yaml11Number

# The modules of the recipe schema, whose sections' `#:` comments are the keys' documentation.
SCHEMA_MODULES = ("align.config", "align.config_inputs")


class DuplicateKey(yaml.YAMLError):
    """A key given twice in one YAML mapping."""

    def __init__(self, key: Any, line: int, first: int) -> None:
        super().__init__(f"line {line}: key '{key}' is given twice (first at line {first})")
        self.key, self.line, self.first = key, line, first


class StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader, refusing a key given twice in one mapping. YAML forbids it, but PyYAML keeps the last value:
    a second `train:` section would silently drop the first, a repeated `lr:` the earlier rate."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` then a key of base: an override, not a repeat
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    raise DuplicateKey(key, key_node.start_mark.line + 1, seen[key])
                seen[key] = key_node.start_mark.line + 1
            except TypeError:  # an unhashable key: the base class says so
                continue
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> Any:
        # YAML 1.1's octal (010 is 8) and base 60 (1:30 is 90): kept as written, for the schema to refuse where a
        # number is wanted (recipe_fields.Yaml11Number); YAML 1.2, and anybody reading the recipe, see 10 and 1:30.
        value = super().construct_yaml_int(node)
        text = str(node.value).replace("_", "")
        if ":" in text or re.fullmatch(r"[-+]?0[0-7]+", text):
            return Yaml11Number(str(node.value), value)
        return value

    def construct_yaml_float(self, node: yaml.ScalarNode) -> Any:
        value = super().construct_yaml_float(node)
        return Yaml11Number(str(node.value), value) if ":" in str(node.value) else value


StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
StrictLoader.add_constructor("tag:yaml.org,2002:float", StrictLoader.construct_yaml_float)


def yaml_load(text: str) -> Any:
    """YAML text as Python values, as yaml.safe_load reads it, but a key given twice in a mapping is an error."""
    return yaml.load(text, Loader=StrictLoader)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.lr=3e-4` -> (["train", "lr"], 3e-4). Values are read as YAML, so `[4, 8]`, `true` and `null` work."""
    key, sep, raw = text.partition("=")
    if not sep or not key or not re.fullmatch(r"[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)*", key):
        raise RecipeError(f"bad override {text!r}: expected key.sub=value, e.g. decode.gamma=8")
    try:
        value = yaml_load(raw) if raw.strip() else None
    except DuplicateKey as e:  # `train.losses={streak: 1, streak: 2}`
        raise RecipeError(f"{key}: {raw}: key '{e.key}' is given twice") from None
    except yaml.YAMLError:
        value = raw
    # YAML 1.1 reads 1e-4 as a string; a float is what anybody writing it means.
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value):
        value = float(value)
    return key.split("."), value


def apply_override(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for depth, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"{'.'.join(path)}: {'.'.join(path[:depth + 1])} is a value, not a section")
        node = child
    node[path[-1]] = value


# Keys that were renamed: old name -> new name, in every section that has the new one. A recipe written for the old
# name is refused with the new one (a silent alias would leave two spellings in recipes people copy).
RENAMED_KEYS = {"prompt_field": "prompt_column"}  # one name for the prompts' column in every section


def _model_in(annotation: Any) -> Any:
    """The recipe section a field's type holds, through Optional, unions and lists (a mixture's list of sources)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((found for arg in get_args(annotation) if (found := _model_in(arg)) is not None), None)


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """Valid field names of the section at `loc` (for 'did you mean' suggestions)."""
    model: Any = Recipe
    for part in loc:
        if isinstance(part, int) or _is_branch(part):  # a list index, pydantic's union branch
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = _model_in(field.annotation)
    return list(getattr(model, "model_fields", {}))


def _is_branch(part: Any) -> bool:
    """Whether a part of pydantic's error location names a branch of a union (`str`, `list[PromptSource]`), not a key."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float"))


def one_line(err: ValidationError) -> str:
    errors = err.errors()
    # A union (data.train_prompts: a path or a list of sources) reports each branch's complaint; the one that matters
    # is the branch the value was written for, not "should be a valid string" about a list.
    # The deepest complaint is the branch that got furthest with the value.
    first = max(errors, key=lambda e: (len(e["loc"]), not e["type"].endswith("_type")))
    # dict keys: name the entry, not pydantic's marker; a list's items as [i]
    loc = tuple(p for p in first["loc"] if p != "[key]" and not _is_branch(p))
    key = re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", ".".join(str(p) for p in loc)) or "recipe"
    if first["type"] == "extra_forbidden":
        valid = _fields_at(loc[:-1])
        section = key.rpartition(".")[0] + "." if "." in key else ""
        if RENAMED_KEYS.get(str(loc[-1])) in valid:
            return f"'{key}' is now '{section}{RENAMED_KEYS[str(loc[-1])]}': rename it"
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
        hint = f"did you mean '{section}{close[0]}'?" if close else f"valid: {', '.join(valid)}"
        return f"unknown key '{key}' ({hint})"
    msg = first["msg"].removeprefix("Value error, ")
    branches = [e["msg"].removeprefix("Input should be ") for e in errors if e["loc"][:-1] == first["loc"][:-1]
                and _is_branch(e["loc"][-1]) and e["type"].endswith("_type")]
    if len(branches) > 1:  # a value none of a union's types takes
        msg = "Input should be " + " or ".join(branches)
    if first["type"] == "missing":
        return f"{key}: required"
    got = first.get("input")
    shown = "" if isinstance(got, dict) else f" (got {got!r})"
    return f"{key}: {msg}{shown}"


def load_recipe(path: str | os.PathLike | None, overrides: list[str] = ()) -> Recipe:
    """Read a recipe YAML (None: all defaults), apply `key.sub=value` overrides, validate. Raises RecipeError."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise RecipeError(f"{path}: is a folder, not a recipe file (e.g. recipes/tiny/eval.yaml)")
        if not path.is_file():
            raise RecipeError(f"recipe not found: {path}")
        try:
            loaded = yaml_load(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise RecipeError(f"{path}: not UTF-8 text; a recipe is a YAML file") from None
        except OSError as e:
            raise RecipeError(f"{path}: cannot read the recipe ({e.strerror})") from None
        except DuplicateKey as e:
            raise RecipeError(f"{path}: {e}; give each key once") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise RecipeError(f"{path}:{where} invalid YAML: {getattr(e, 'problem', None) or e}") from None
        # An empty file is most likely the wrong file (or one cut short), not a request for every default; `{}` says
        # that explicitly.
        if loaded is None:
            raise RecipeError(f"{path}: empty recipe (write `{{}}` in it to run on every default)")
        if not isinstance(loaded, dict):
            raise RecipeError(f"{path}: a recipe is a mapping of sections, got {type(loaded).__name__}")
        tree = loaded
    for text in overrides:
        keys, value = parse_override(text)
        apply_override(tree, keys, value)
    try:
        return Recipe.model_validate(tree)
    except ValidationError as e:
        raise RecipeError(one_line(e)) from None


def get_key(recipe: Recipe, key: str) -> Any:
    """The resolved value of a dotted key (a section as a plain dict); a dict's entries are keys too
    (`eval.compare_drafters.<label>`). An unknown key is a RecipeError."""
    node: Any = recipe
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, BaseModel) and part in type(node).model_fields:
            node = getattr(node, part)
        else:
            raise RecipeError(f"unknown key '{key}'")
    return node.model_dump(mode="json") if isinstance(node, BaseModel) else node


def section_class(name: str) -> type[BaseModel]:
    """The schema class of recipe section `name` (an optional one's, `dflash`, without its None)."""
    annotation = Recipe.model_fields[name].annotation
    return next((t for t in get_args(annotation) if t is not type(None)), annotation)


@functools.lru_cache(maxsize=None)
def key_meanings(section: type[BaseModel]) -> dict[str, str]:
    """Each field of a recipe section -> what it means: the `#:` comment lines above it in its class (or a base
    class's) source, the schema's one home of key documentation, read here for `align <stage> --help` and the
    recipes `align init` writes. Fields without such a comment are left out."""
    import inspect

    meanings: dict[str, str] = {}
    for cls in reversed(section.__mro__):  # a subclass's own comment wins over its base's
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or cls.__module__ not in SCHEMA_MODULES:
            continue
        comment: list[str] = []
        for line in inspect.getsourcelines(cls)[0]:
            text = line.strip()
            if text.startswith("#:"):
                comment.append(text[2:].strip())
                continue
            field = re.match(r"(\w+)\s*:", text)
            if field and comment and field.group(1) in section.model_fields:
                meanings[field.group(1)] = " ".join(comment)
            comment = []
    return meanings
