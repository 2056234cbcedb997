"""The configuration reference on the documentation site is generated from the config
dataclasses (`distflow.config.reference`); here: it lists every key, including the fields of
list entries and optional sub-sections, each with its type, default and a docstring, and the
Algorithms page's table names every built-in algorithm."""

import dataclasses
import types
import typing

from conftest import REPO

from distflow.config import Config
from distflow.config.algorithm import ALGORITHMS
from distflow.config.reference import reference_markdown


def every_key(cls: type, prefix: str = "") -> set[str]:
    """Every key of `cls`, dotted, walked independently of the generator: a dataclass field, an
    optional dataclass and a list of dataclasses are keys themselves and have keys inside
    (`task.rewards`, `task.rewards[].fn`)."""
    hints = typing.get_type_hints(cls)
    keys = set()
    for field in dataclasses.fields(cls):
        key, hint = prefix + field.name, hints[field.name]
        keys.add(key)
        args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if dataclasses.is_dataclass(hint):
            keys |= every_key(hint, key + ".")
        elif (
            typing.get_origin(hint) in (typing.Union, types.UnionType)
            and len(args) == 1
            and dataclasses.is_dataclass(args[0])
        ):
            keys |= every_key(args[0], key + ".")
        elif typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
            keys |= every_key(args[0], key + "[].")
    return keys


def table_cells(line: str) -> list[str]:
    """The cells of a Markdown table row, split as Markdown does: not at a `|` inside a code span
    or escaped as `\\|`."""
    cells, cell, in_code, escaped = [], "", False, False
    for char in line.strip()[1:-1]:
        if char == "|" and not in_code and not escaped:
            cells.append(cell.strip())
            cell = ""
            continue
        in_code ^= char == "`"
        escaped = char == "\\"
        cell += char
    return cells + [cell.strip()]


def reference_rows() -> dict[str, list[str]]:
    """`key -> [type, default, meaning]` of every row of the generated reference's tables."""
    rows = {}
    for line in reference_markdown().splitlines():
        if line.startswith("| `"):
            cells = table_cells(line)
            assert len(cells) == 4, line
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_the_reference_lists_every_key_with_its_type_default_and_doc():
    rows, keys = reference_rows(), every_key(Config) - set(f.name for f in dataclasses.fields(Config))
    assert {
        "algorithm.kl.coef",
        "placement.train.ranks_per_replica",
        "task.rewards[].weight",
        "task.reasoning_gym.datasets[].name",
        "pipeline.custom_stages[].fn",
    } <= keys
    assert sorted(keys - set(rows)) == [], "config keys missing from the generated reference"
    assert sorted(set(rows) - keys - part_keys()) == [], "reference rows that are no config key"
    undocumented = sorted(key for key, (type_, default, doc) in rows.items() if not (type_ and default and doc))
    assert undocumented == [], (
        "config keys without an attribute docstring (the string right below the field, which the reference prints)"
    )


def part_keys() -> set[str]:
    """The keys of every built-in part's own options, under its name in its section (`rollout.vllm.log`), found
    from the registries independently of the generator."""
    from distflow.config import components

    keys = set()
    for registry in (components.ROLLOUT_ENGINES, components.TASK_SOURCES, components.TRAINED_MODELS):
        for name in registry.builtins():
            options = getattr(registry.get(name), "Config", None)
            if options is not None:
                prefix = f"{registry.key.split('.')[0]}.{name}"
                keys |= {prefix} | every_key(options, prefix + ".")
    return keys


def test_the_reference_lists_every_parts_own_options_under_its_name():
    """The parts' options are keys too (`rollout: {engine: vllm, vllm: {log: true}}`): each is in the reference
    with its type, default and docstring, and the config reads it where the reference says."""
    from distflow.config import load_config

    rows, keys = reference_rows(), part_keys()
    assert {"rollout.compact.slots", "rollout.vllm.log", "task.verifiers.env", "task.verifiers.harness"} <= keys
    assert sorted(keys - set(rows)) == [], "part options missing from the generated reference"
    assert all(rows[key][2] for key in keys), "part options without a docstring"
    assert rows["rollout.compact.slots"][:2] == ["`int`", "`0`"]
    assert load_config(None, ["rollout.compact.slots=4"]).rollout.options["slots"] == 4


def test_the_reference_shows_defaults_as_yaml_and_sections_with_their_docs():
    rows = reference_rows()
    assert rows["trainer.loggers"][:2] == ["`list[str]`", "`[jsonl, tensorboard]`"]
    assert rows["optim.betas"][1] == "`[0.9, 0.99]`"
    assert rows["model.path"][1] == "`null`" and rows["data.prefetch"][1] == "`true`"
    assert rows["task.rewards[].fn"][1] == "`required`"
    assert rows["parallel.fsdp"][1] == "`(section)`"
    text = reference_markdown()
    for field in dataclasses.fields(Config):
        heading = f"## `{field.name}`\n\n"
        assert heading in text and text.split(heading, 1)[1].split("\n", 1)[0].strip(), field.name


def test_the_algorithms_table_names_every_built_in_algorithm():
    page = (REPO / "docs" / "features" / "algorithms.md").read_text(encoding="utf-8")
    header = "| `algorithm.name` | what it is |"
    table = page.split(header, 1)[1].split("\n\n", 1)[0]
    names = [
        line.split("|")[1].strip().strip("`")
        for line in table.splitlines()
        if line.startswith("|") and not line.startswith("|---")
    ]
    assert names == list(ALGORITHMS)
