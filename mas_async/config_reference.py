"""The configuration reference, generated from the typed config models (mas_async/config.py).

Every key a YAML file or a `section.key=value` override can set is one `Entry`: its dotted path, its type
and constraints, its default and the docstring under its declaration. The documentation site renders
`reference_markdown()` at build time (docs/hooks.py), so the reference cannot drift from the code, and
tests/unit/framework/test_docs_site.py checks that it lists every field of every model in config.py.

Paths use the names a user types: `policies.<policy>.lr` for a dict of sections keyed by the user's own
names, `cluster.nodes[].address` for a list of sections, and an optional section (`policies.<policy>.lora`,
`metrics.wandb`) is expanded like any other, its own row saying it is off by default.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from mas_async.config import Config

KEY_NAMES = {"policies": "<policy>", "agents": "<agent>"}
"""What stands for a user's own key of a dict of sections in a path (other dicts: `<name>`)."""


@dataclass(frozen=True)
class Entry:
    """One configuration key."""

    path: str
    """Dotted path, e.g. `algorithm.k` or `policies.<policy>.lora.r`."""
    model: type[BaseModel]
    """The model that declares the field."""
    field: str
    type: str
    default: str
    doc: str
    section: type[BaseModel] | None
    """The model of the section this key opens (its keys follow, under `path.`), if it is one."""


def entries(model: type[BaseModel] = Config, prefix: str = "") -> list[Entry]:
    """Every key of `model` and of the sections below it, depth first, in declaration order."""
    out: list[Entry] = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        section, below = _section(info.annotation, name)
        out.append(Entry(path, model, name, _type(info), _default(info, section), _doc(info), section))
        if section is not None:
            out.extend(entries(section, f"{path}{below}."))
    return out


def reference_markdown() -> str:
    """The configuration reference page: one table per section, keys in declaration order."""
    rows = entries()
    lines = [
        "# Configuration reference",
        "",
        "Generated from the typed models in `mas_async/config.py` when the site is built: every key, its type, "
        "default and the docstring under its declaration. Set a key in the YAML file or on the command line "
        "(`mas-async train CONFIG section.key=value`); an unknown key is an error naming it and the file.",
        "",
        "In a path, `<policy>` and `<agent>` stand for your own names (the keys of `policies` and `agents`), "
        "`[]` for each item of a list.",
        "",
    ]
    for title, model, keys in _tables(rows):
        lines += [f"## `{title}`" if title else "## Top level", ""]
        if model.__doc__ and model.__doc__ is not BaseModel.__doc__ and "__doc__" in model.__dict__:
            lines += [_cell(_flat(model.__doc__)), ""]
        lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        for entry in keys:
            below = f"{entry.path}{_below(entry)}"
            doc = _cell(entry.doc) + (
                f" *A section: its keys are under `{below}`.*" if entry.section is not None else ""
            )
            lines.append(f"| `{entry.path}` | {_cell(entry.type)} | {_cell(entry.default)} | {doc} |")
        lines.append("")
    return "\n".join(lines)


def _tables(rows: list[Entry]) -> list[tuple[str, type[BaseModel], list[Entry]]]:
    """(section title, its model, its own keys) for the top level and each section, in order of appearance."""
    tables: list[tuple[str, type[BaseModel], list[Entry]]] = [("", Config, [])]
    index = {"": 0}
    for entry in rows:
        parent = entry.path.rsplit(".", 1)[0] if "." in entry.path else ""
        tables[index[parent]][2].append(entry)
        if entry.section is not None:
            key = f"{entry.path}{_below(entry)}"
            index[key] = len(tables)
            tables.append((key, entry.section, []))
    return [t for t in tables if t[2]]


def _below(entry: Entry) -> str:
    return _section(entry.model.model_fields[entry.field].annotation, entry.field)[1]


def _section(annotation: Any, name: str) -> tuple[type[BaseModel] | None, str]:
    """(the section model a field opens, the path part between the field and the section's keys)."""
    annotation = _strip_optional(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is dict and len(args) == 2 and isinstance(args[1], type) and issubclass(args[1], BaseModel):
        return args[1], f".{KEY_NAMES.get(name, '<name>')}"
    if origin is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0], "[]"
    return None, ""


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _type(info: FieldInfo) -> str:
    text = _annotation(info.annotation)
    bounds = [_bound(m) for m in info.metadata]
    return ", ".join([text, *(b for b in bounds if b)])


def _annotation(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        return " \\| ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " \\| ".join(_annotation(a) for a in args)
    if origin is typing.Annotated:
        inner = _annotation(args[0])
        bounds = [b for b in (_bound(m) for m in args[1:]) if b]
        return f"{inner} ({', '.join(bounds)})" if bounds else inner
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_annotation(a) for a in args)}]"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _bound(meta: Any) -> str:
    """A constraint of pydantic's Field(...) (annotated_types' Ge, Gt, ..., or a pattern) in words."""
    for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if getattr(meta, attr, None) is not None and type(meta).__name__.lower() == attr:
            return f"{sign} {getattr(meta, attr)}"
    if type(meta).__name__ == "MinLen":
        return f"at least {meta.min_length} item(s)"
    if isinstance(meta, FieldInfo):  # Annotated[str, Field(pattern=...)] inside a list
        return ", ".join(b for b in (_bound(m) for m in meta.metadata) if b)
    pattern = getattr(meta, "pattern", None)
    if pattern:
        return f"matching `{pattern}`"
    return ""


def _default(info: FieldInfo, section: type[BaseModel] | None) -> str:
    if info.default is PydanticUndefined and info.default_factory is None:
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None and section is not None:
        return "null (off)"
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return f"`{text.removesuffix('...').strip()}`"


def _doc(info: FieldInfo) -> str:
    return _flat(info.description or "")


def _flat(text: str) -> str:
    return " ".join(text.split())


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: outside backticks a `|` would end the cell and `<name>` would be
    read as an HTML tag (inside backticks the table extension keeps both as they are)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        plain = parts[i].replace("\\|", "|").replace("|", "\\|")
        parts[i] = plain.replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)
