"""The README's configuration reference names every config key and nothing else; its
Algorithms table names every built-in algorithm."""

import dataclasses
import re
import typing

from conftest import REPO
from distflow.config import Config
from distflow.config.algorithm import ALGORITHMS

README = (REPO / "README.md").read_text(encoding="utf-8")


def config_keys(cls: type, prefix: str = "") -> set[str]:
    """Every leaf key of `cls`, dotted (a list of entries, like task.rewards, is one key)."""
    hints = typing.get_type_hints(cls)
    keys = set()
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            keys |= config_keys(hints[field.name], f"{prefix}{field.name}.")
        else:
            keys.add(prefix + field.name)
    return keys


def first_cells(section: str, header: str) -> list[str]:
    """The first cell of each row of the tables of README section `section` whose header is `header`."""
    text = README.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    cells, in_table = [], False
    for line in text.splitlines():
        if line.startswith(header):
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and not line.startswith("|---"):
            cells.append(line.split("|")[1].strip())
    return cells


def reference_keys() -> set[str]:
    """`a.b.c`, `d` in a row's first cell stands for a.b.c and a.b.d."""
    keys = set()
    for cell in first_cells("Configuration reference", "| key | default | meaning |"):
        names = re.findall(r"`([^`]+)`", cell)
        section = names[0].rpartition(".")[0]
        keys |= {name if "." in name else f"{section}.{name}" for name in names}
    return keys


def test_the_reference_names_every_config_key_and_only_those():
    documented, actual = reference_keys(), config_keys(Config)
    assert "algorithm.kl.coef" in actual and "placement.train.ranks_per_replica" in actual
    assert not actual - documented, f"config keys missing from the README reference: {sorted(actual - documented)}"
    assert not documented - actual, f"README reference keys that are no config key: {sorted(documented - actual)}"


def test_the_algorithms_table_names_every_built_in_algorithm():
    names = [cell.strip("`") for cell in first_cells("Algorithms", "| `algorithm.name` | what it is |")]
    assert names == list(ALGORITHMS)
