"""The configuration reference, generated from the config dataclasses.

Every key of `Config`, walked section by section (`parallel.fsdp.shard_size`), with its type as
annotated, its default and its attribute docstring (the string right below the field, the
house convention of this package). Optional sub-sections (`task.dataset`) and lists of entries
(`task.rewards`) are listed as a key of their own and then field by field
(`task.rewards[].weight`). The documentation site's configuration page is this module's
`reference_markdown()` (docs/hooks.py puts it there at build time), so a key added to a
dataclass is on the site without anyone editing a table; tests/test_config_reference.py fails
when a key has no docstring.

A built-in part that owns options (a `Component` whose `Config` is a dataclass: `rollout.compact`,
`rollout.vllm`, `task.verifiers`) is listed in its section under its name, then walked, as the section
reads it (`rollout: {engine: vllm, vllm: {log: true}}`). Finding them imports each part's module (torch
among them); the rest reads the sources (`ast`, `inspect`).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass

from distflow.config.schema import Config


@dataclass(frozen=True)
class Entry:
    """One row of the reference."""

    key: str
    """Dotted key as written in YAML or an override; `[]` marks the fields of a list's entries."""
    type: str
    """The annotation as written in the dataclass (`int`, `str | None`, `list[RewardSpec]`)."""
    default: str
    """The default as YAML would spell it; `required` for a field without one."""
    doc: str
    """The field's attribute docstring, on one line ('' when it has none)."""


@dataclass(frozen=True)
class Section:
    """A top-level section (`trainer`) and its rows."""

    name: str
    doc: str
    entries: list[Entry]


def attribute_docs(cls: type) -> dict[str, str]:
    """`field name -> docstring` of `cls`: a string literal right after an annotated assignment in
    the class body (PEP 257's attribute docstrings; Sphinx and mkdocstrings read them too).

    >>> from distflow.config.schema import CheckpointConfig
    >>> attribute_docs(CheckpointConfig)["keep_last"]
    'Complete checkpoints kept; older ones are deleted once a newer one is complete.'
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for statement, following in zip(body, body[1:], strict=False):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = " ".join(inspect.cleandoc(following.value.value).split())
    return docs


def _nested_dataclass(hint: object) -> tuple[type | None, str]:
    """(the dataclass `hint` holds, how): `section` for a dataclass, `optional` for one or None,
    `list` for a list of them; (None, '') for anything else."""
    if dataclasses.is_dataclass(hint):
        return hint, "section"
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [arg for arg in args if arg is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            return inner[0], "optional"
    if origin is list and len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0], "list"
    return None, ""


def yaml_value(value: object) -> str:
    """`value` as YAML spells it in a config.

    >>> yaml_value(None), yaml_value(True), yaml_value((0.9, 0.99)), yaml_value(["jsonl", "tensorboard"])
    ('null', 'true', '[0.9, 0.99]', '[jsonl, tensorboard]')
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {yaml_value(item)}" for key, item in value.items()) + "}"
    return str(value)


def _annotation(field: dataclasses.Field) -> str:
    """The annotation as written: a string under `from __future__ import annotations`, else the type's name."""
    return field.type if isinstance(field.type, str) else inspect.formatannotation(field.type)


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return yaml_value(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return yaml_value(field.default_factory())
    return "required"


def entries(cls: type = Config, prefix: str = "") -> list[Entry]:
    """Every key of `cls` and of the dataclasses inside it, in declaration order: a sub-section
    (`parallel.fsdp`), an optional sub-section or a list of entries is listed, then walked."""
    hints, docs = typing.get_type_hints(cls), attribute_docs(cls)
    rows = []
    for field in dataclasses.fields(cls):
        key = prefix + field.name
        nested, how = _nested_dataclass(hints[field.name])
        doc = docs.get(field.name, "")
        if how == "section":
            rows.append(Entry(key=key, type=_annotation(field), default="(section)", doc=doc))
            rows += entries(nested, key + ".")
            continue
        rows.append(Entry(key=key, type=_annotation(field), default=_default(field), doc=doc))
        if nested is not None:
            rows += entries(nested, key + ("[]." if how == "list" else "."))
    return rows


def part_entries() -> dict[str, list[Entry]]:
    """Section name → the rows of its built-in parts' own options (`rollout.vllm`, `rollout.vllm.log`), each
    registry's parts in its order."""
    from distflow.config import components

    rows: dict[str, list[Entry]] = {}
    registries = [r for r in vars(components).values() if type(r) is components.Registry]  # classes, not functions
    for registry in registries:
        section = registry.key.split(".")[0]
        for name in registry.builtins():
            part = registry.get(name)
            options = getattr(part, "Config", None) if isinstance(part, type) else None
            if options is None or not dataclasses.is_dataclass(options):
                continue
            key, doc = (
                f"{section}.{name}",
                f"The options of `{registry.key}: {name}` ({registry.kind}); also `{section}.options`.",
            )
            rows.setdefault(section, []).append(Entry(key=key, type=options.__name__, default="(section)", doc=doc))
            rows[section] += entries(options, key + ".")
    return rows


def sections() -> list[Section]:
    """`Config`'s top-level sections, each with its docstring and its rows, its parts' options last."""
    docs = attribute_docs(Config)
    hints = typing.get_type_hints(Config)
    parts = part_entries()
    return [
        Section(
            name=field.name,
            doc=docs.get(field.name, ""),
            entries=entries(hints[field.name], field.name + ".") + parts.get(field.name, []),
        )
        for field in dataclasses.fields(Config)
    ]


def _cell(text: str) -> str:
    """`text` for a table cell: a `|` outside code spans escaped (Markdown tables keep the ones inside).

    >>> _cell("|x| > 1, `str | None`")
    '\\\\|x\\\\| > 1, `str | None`'
    """
    parts = text.split("`")
    return "`".join(part if i % 2 else part.replace("|", "\\|") for i, part in enumerate(parts))


def reference_markdown() -> str:
    """The reference as Markdown: a heading and a table (key, type, default, meaning) per section."""
    out = []
    for section in sections():
        out += [f"## `{section.name}`", "", section.doc, "", "| key | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{e.key}` | `{e.type}` | `{e.default}` | {_cell(e.doc)} |" for e in section.entries]
        out.append("")
    return "\n".join(out)
