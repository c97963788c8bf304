"""Write docs/configuration.md, the config reference, from the typed schemas and the YAML files.

Why generated
    The schema dataclasses (sdnet_trainer/config/schema.py) are the single source of truth for
    every key: Hydra merges each YAML file onto them, so a key that is not there does not exist.
    Their comments are the documentation. A reference written by hand would drift from both; this
    one is rebuilt from them, and tests/unit/test_docs.py fails when the file in the repository
    is stale.

What it lists
    * every key under ``Config``, recursively through nested dataclasses, with its full dotted
      name, its type as annotated, its default, and the comment lines directly above the field
      plus any comment on the field's own line;
    * each config group (a folder of configs/) with its default option from configs/config.yaml
      and every option file with the first comment line of that file;
    * the recipes (recipes/*.yaml) with their first comment line.

    The output depends only on the repository's files (sorted, no timestamps, no absolute paths).

Run (from anywhere)
    python scripts/docs/gen_config_docs.py            # (re)write docs/configuration.md
    python scripts/docs/gen_config_docs.py --check    # exit 1 with a diff summary if the file is stale
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import io
import sys
import tokenize
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
OUTPUT = REPO / "docs" / "configuration.md"
CONFIGS = REPO / "configs"
RECIPES = REPO / "recipes"
ROOT_CONFIG = CONFIGS / "config.yaml"
COMMAND = "python scripts/docs/gen_config_docs.py"

if str(REPO) not in sys.path:  # run as a file: the package lives next to scripts/
    sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Key:
    """One leaf of the config tree."""

    name: str  # full dotted name, e.g. model.gpt.n_heads
    type: str  # the annotation as written in the source
    default: str  # as YAML would spell it
    doc: str  # the field's comments, joined


@dataclass(frozen=True)
class Section:
    """The keys of one dataclass, found at ``name`` in the tree (``""`` for the root)."""

    name: str
    doc: str  # the class docstring, if any
    keys: list[Key]


# ---------------------------------------------------------------------- the schema


@dataclass(frozen=True)
class _FieldSource:
    annotation: str
    comments: list[str]


@cache
def _comments_by_line(path: Path) -> dict[int, tuple[str, bool]]:
    """{line: (comment text, alone on its line)} for every comment of a Python file."""
    source = path.read_text()
    lines = source.splitlines()
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            alone = not lines[row - 1][:col].strip()
            found[row] = (token.string.lstrip("#").strip(), alone)
    return found


@cache
def _class_fields(cls: type) -> dict[str, _FieldSource]:
    """Annotation text and comments of each field of a dataclass, read from its source file."""
    source_file = inspect.getsourcefile(cls)
    if source_file is None:
        raise RuntimeError(f"class {cls.__name__} has no source file")
    path = Path(source_file)
    tree = ast.parse(path.read_text())
    node = next(
        (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__), None
    )
    if node is None:
        raise RuntimeError(f"class {cls.__name__} not found in {path}")
    comments = _comments_by_line(path)
    fields = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above: list[str] = []
        row = stmt.lineno - 1
        # A block of comment lines right above the field.
        while row in comments and comments[row][1]:
            above.insert(0, comments[row][0])
            row -= 1
        # ast.parse sets end_lineno on every statement it builds.
        end_lineno = stmt.end_lineno if stmt.end_lineno is not None else stmt.lineno
        inline = [
            comments[r][0]
            for r in range(stmt.lineno, end_lineno + 1)
            if r in comments and not comments[r][1]
        ]
        fields[stmt.target.id] = _FieldSource(ast.unparse(stmt.annotation), above + inline)
    return fields


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return "???"  # mandatory, as OmegaConf spells it


def _yaml(value: Any) -> str:
    """A default as it would be written on the command line or in a YAML file."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _join(lines: list[str]) -> str:
    """Comment lines as one paragraph (a comment wrapped over lines is one sentence)."""
    return " ".join(line for line in lines if line)


def walk(cls: type, prefix: str = "") -> list[Section]:
    """Sections of ``cls`` and of every dataclass nested in it, depth first, in field order."""
    sources = _class_fields(cls)
    keys: list[Key] = []
    nested: list[Section] = []
    for field in dataclasses.fields(cls):
        name = f"{prefix}{field.name}"
        default = _default(field)
        source = sources.get(field.name, _FieldSource(str(field.type), []))
        if dataclasses.is_dataclass(default):
            nested += walk(type(default), prefix=f"{name}.")
            continue
        keys.append(
            Key(
                name=name,
                type=source.annotation,
                default=_yaml(default),
                doc=_join(source.comments),
            )
        )
    doc = (
        inspect.cleandoc(cls.__doc__)
        if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}(")
        else ""
    )
    own = [Section(name=prefix.rstrip("."), doc=doc, keys=keys)] if prefix or keys or doc else []
    return own + nested


# ---------------------------------------------------------------------- YAML files


def first_comment(path: Path) -> str:
    """The first sentence of the comment that opens a YAML file (Hydra's ``# @package`` directive
    aside), with a leading ``NAME:`` that repeats the file's name dropped. A sentence wrapped over
    several comment lines is joined; an indented line (a command example) ends it."""
    sentence: list[str] = []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped.startswith("#"):
            if stripped or sentence:
                break  # the comments that open a file describe it; later ones describe keys
            continue
        body = stripped[1:]
        text = body.strip()
        if text.startswith("@package"):
            continue
        if not text or (sentence and body.startswith("  ")):
            if sentence:
                break
            continue
        sentence.append(text)
        if text.endswith("."):
            break
    text = " ".join(sentence)
    if text.endswith("e.g."):  # "..., e.g." introduces an example that follows on its own lines
        text = text[: -len("e.g.")].rstrip(" ,") + "."
    prefix = f"{path.stem}:"
    return text[len(prefix) :].strip() if text.startswith(prefix) else text


def group_defaults() -> dict[str, str]:
    """{group: option} from the defaults list of configs/config.yaml."""
    from omegaconf import OmegaConf

    defaults = {}
    root = OmegaConf.to_container(OmegaConf.load(ROOT_CONFIG))
    assert isinstance(root, dict)  # configs/config.yaml is a mapping
    for entry in root.get("defaults", []):
        if isinstance(entry, dict):
            for group, option in entry.items():
                if not str(group).startswith("override ") and "/" not in str(group):
                    defaults[str(group)] = str(option)
    return defaults


def groups() -> dict[str, list[Path]]:
    """{group: option files} for every folder of configs/ that holds YAML files."""
    found = {}
    for folder in sorted(p for p in CONFIGS.iterdir() if p.is_dir()):
        options = sorted(folder.glob("*.yaml"))
        if options:
            found[folder.name] = options
    return found


# ---------------------------------------------------------------------- rendering


def _cell(text: str) -> str:
    """Text for a Markdown table cell: one line, pipes escaped (also inside code spans)."""
    return " ".join(text.split()).replace("|", "\\|")


def _text(text: str) -> str:
    """Prose from comments, safe in Markdown: ``<run dir>`` is not an HTML tag, ``*.jpg`` no
    emphasis."""
    return _cell(text).replace("*", "\\*").replace("<", "&lt;")


def _code(text: str) -> str:
    return f"`{_cell(text)}`" if text else ""


def render() -> str:
    from sdnet_trainer.config.schema import Config

    sections = walk(Config)
    options = groups()
    defaults = group_defaults()
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated by `{COMMAND}` from sdnet_trainer/config/schema.py, configs/ and "
        "recipes/. Do not edit by hand: change the schema's comments or the YAML files and run it "
        "again. -->",
        "",
        "Every key below can be set on the command line (`key=value`), in a recipe, or in a config "
        "group file. The types and defaults are those of the typed schema "
        "(`sdnet_trainer/config/schema.py`); the option files of a group (`group=option`) set "
        "some of them differently, and the defaults column does not include those.",
        "",
        "## Config groups",
        "",
        "`configs/config.yaml` picks one option of each group; `group=option` on the command line "
        "picks another.",
        "",
        "| group | default | options |",
        "| --- | --- | --- |",
    ]
    for group, files in options.items():
        names = ", ".join(f"`{p.stem}`" for p in files)
        out.append(f"| `{group}` | {_code(defaults.get(group, ''))} | {names} |")
    out += [
        "",
        "## Recipes",
        "",
        "`+recipe=NAME` loads `recipes/NAME.yaml` over the root config.",
        "",
        "| recipe | what it is |",
        "| --- | --- |",
    ]
    for path in sorted(RECIPES.glob("*.yaml")):
        out.append(f"| `{path.stem}` | {_text(first_comment(path))} |")
    out += ["", "## Keys", ""]
    for section in sections:
        title = section.name or "(top level)"
        depth = "###" if "." not in section.name else "####"
        out += [f"{depth} `{title}`", ""]
        if section.doc:
            out += [_text(section.doc), ""]
        group = section.name.split(".")[0]
        if section.name == group and group in options:
            out += [f"Options (`{group}=NAME`, files in `configs/{group}/`):", ""]
            for path in options[group]:
                comment = first_comment(path)
                out.append(f"- `{path.stem}`" + (f": {_text(comment)}" if comment else ""))
            out.append("")
        if section.keys:
            out += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
            for key in section.keys:
                out.append(
                    f"| `{key.name}` | {_code(key.type)} | {_code(key.default)} "
                    f"| {_text(key.doc)} |"
                )
            out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def stale_summary(current: str, expected: str, *, limit: int = 40) -> str:
    """A short unified diff of the file against what the generator writes now."""
    diff = list(
        difflib.unified_diff(
            current.splitlines(),
            expected.splitlines(),
            fromfile=f"{_shown(OUTPUT)} (in the repository)",
            tofile=f"{_shown(OUTPUT)} (generated now)",
            lineterm="",
        )
    )
    changed = sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))
    shown = diff[:limit] + (
        [f"... {len(diff) - limit} more diff lines"] if len(diff) > limit else []
    )
    return "\n".join([f"{changed} lines differ:"] + shown)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 with a diff summary if the file is stale",
    )
    args = parser.parse_args(argv)
    expected = render()
    current = OUTPUT.read_text() if OUTPUT.exists() else ""
    if args.check:
        if current == expected:
            print(f"{_shown(OUTPUT)} is up to date")
            return 0
        print(f"{_shown(OUTPUT)} is stale: run {COMMAND}\n{stale_summary(current, expected)}")
        return 1
    if current != expected:
        OUTPUT.parent.mkdir(parents=True, exist_ok=True)
        tmp = OUTPUT.with_name(OUTPUT.name + ".tmp")
        tmp.write_text(expected)
        tmp.replace(OUTPUT)  # whole or not at all
    print(f"wrote {_shown(OUTPUT)}" if current != expected else f"{_shown(OUTPUT)} unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
