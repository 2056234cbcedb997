"""What `distflow.train` is given as Python values, turned into config entries every rank can read.

a callable (reward, environment class, engine class, policy loss, agent) ──► its name in the config,
    `module:qualname`; a part that is a value (an Estimator) ──► the same, named by the top-level
    variable holding it where launched ranks import it
    run in this process ──► the object itself, provided under that name (config/callables.py)
    launched ranks      ──► imported there by that name: a module's top-level function or class
                            (a script's own: the script imported by its file name); one that
                            cannot be (a notebook's, a lambda) is a ConfigError naming it
rows (list of dicts, a datasets.Dataset, {"train": ..., "test": ...}) ──► .jsonl files in a
    temporary folder (removed when the run ends) ──► task.train_file / task.heldout_file, and
    task.given_rows: what the caller calls those rows, so that a bad one is named `dataset[i]`
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from distflow.config.errors import ConfigError

PARTS = {
    "engine": "rollout.engine",
    "estimator": "algorithm.estimator",
    "policy_loss": "algorithm.policy_loss",
    "agent": "rollout.agent",
}
"""`distflow.train`'s arguments that give a part itself (a class, a function, an instance) → the key that names it."""
INSTANCES = ("estimator",)
"""The arguments whose parts are values, not classes or functions."""


class Inputs:
    """The objects and files one `distflow.train` call hands to its run."""

    def __init__(self, *, launched: bool, nproc: int) -> None:
        self.launched, self.nproc = launched, nproc
        self.objects: dict[str, object] = {}
        """Objects provided to a run in this process, by their name in the config."""
        self.import_paths: list[str] = []
        """Folders launched ranks need on their import path (a script's own folder)."""
        self._folder: Path | None = None

    def apply(
        self,
        data: dict,
        *,
        num_heldout: int,
        rewards: Any = None,
        dataset: Any = None,
        heldout: Any = None,
        env: Any = None,
        parts: Mapping[str, Any] | None = None,
    ) -> None:
        """Set the config entries (`data`, a plain config mapping) of what was given; `parts`: argument name →
        the part given for it (`PARTS`)."""
        task = data["task"]
        for argument, part in (parts or {}).items():
            if part is not None:
                section, key = PARTS[argument].split(".")
                data.setdefault(section, {})[key] = self.reference(part, argument, instance=argument in INSTANCES)
        if rewards is not None:
            items = list(rewards) if isinstance(rewards, (list, tuple)) else [rewards]
            if not items:
                raise ConfigError("rewards is empty: give a reward function (or leave rewards out)")
            specs = [self.reference(fn, f"rewards[{i}]" if len(items) > 1 else "rewards") for i, fn in enumerate(items)]
            if len(items) == 1:
                task["reward"], task["rewards"] = specs[0], []
            else:
                names = _unique([spec.rpartition(":")[2].split("#")[0] for spec in specs])
                task["rewards"] = [{"fn": spec, "name": name} for spec, name in zip(specs, names, strict=True)]
        if env is not None:
            data["env"]["cls"] = self.reference(env, "env")
        if dataset is not None:
            task["train_file"], task["heldout_file"], task["given_rows"] = self._files(dataset, heldout, num_heldout)
            task["dataset"] = task["reasoning_gym"] = None
            task["source"] = "files"
        elif heldout is not None:
            raise ConfigError("heldout rows were given without dataset: give the training rows as dataset too")

    def reference(self, obj: Callable | str, key: str, *, instance: bool = False) -> str:
        """The config's name for `obj` (an import string is used as it is); `instance`: the kind's parts are
        values (an `Estimator`), named by the module attribute that holds them where ranks import them."""
        if isinstance(obj, str):
            return obj
        if not callable(obj) and not instance:
            raise ConfigError(
                f"{key} must be a function, a class or a 'package.module:name' string (got {type(obj).__name__})"
            )
        module = getattr(obj, "__module__", None) or type(obj).__module__
        qualname = getattr(obj, "__qualname__", None) or f"{type(obj).__qualname__}()"
        if self.launched and instance and not hasattr(obj, "__qualname__"):
            module, qualname = _holder(obj, key, self.nproc)
        if self.launched:
            return self._importable(obj, key, module, qualname)
        spec, n = f"{module}:{qualname}", 1
        while spec in self.objects and self.objects[spec] is not obj:  # two lambdas: two names
            n += 1
            spec = f"{module}:{qualname}#{n}"
        self.objects[spec] = obj
        return spec

    def _importable(self, obj: object, key: str, module: str, qualname: str) -> str:
        """`module:qualname` as a launched rank imports it; a ConfigError when it cannot."""
        what = f"{key} ({getattr(obj, '__name__', type(obj).__name__)!r})"
        ranks = f"the {self.nproc} ranks that nproc={self.nproc} starts"
        if "<" in qualname or "." in qualname or not (hasattr(obj, "__qualname__") or qualname.isidentifier()):
            raise ConfigError(
                f"{what} is not a top-level function or class of a module, so {ranks} cannot import "
                "it; define it with def/class at the top level of a module, or train with nproc=1"
            )
        if module == "__main__":
            main = sys.modules["__main__"]
            if getattr(main, "__file__", None) is None:
                raise ConfigError(
                    f"{what} is defined in __main__ of an interactive session (a notebook), which "
                    f"{ranks} cannot import; move it into a module (a .py file) and import it from "
                    "there, or train with nproc=1"
                )
            main_spec = getattr(main, "__spec__", None)
            if main_spec is not None:  # python -m package.module
                module = main_spec.name
            else:  # python script.py: the ranks import the script by its file name
                module = Path(main.__file__).stem
                self.import_paths.append(str(Path(main.__file__).resolve().parent))
        return f"{module}:{qualname}"

    def _files(self, dataset: Any, heldout: Any, num_heldout: int) -> tuple[str, str, dict]:
        """(train file, held-out file, `task.given_rows`) of the rows given."""
        names = {"train": "dataset", "heldout": "heldout", "heldout_start": 0}
        if isinstance(dataset, Mapping):  # {"train": ..., "test": ...} or a datasets.DatasetDict
            if "train" not in dataset:
                raise ConfigError(f"dataset has no 'train' split; it has {sorted(dataset)}")
            if heldout is None:
                split = next((s for s in ("test", "validation") if s in dataset), None)
                if split is None:
                    raise ConfigError(
                        f"dataset has no 'test' or 'validation' split (it has {sorted(dataset)}): "
                        "give the held-out rows as heldout"
                    )
                heldout = dataset[split]
                names["heldout"] = f"dataset[{split!r}]"
            dataset = dataset["train"]
            names["train"] = "dataset['train']"
        rows = _rows(dataset, names["train"])
        if heldout is None:
            count = max(1, min(num_heldout, len(rows) // 10))
            if len(rows) < 2:
                raise ConfigError(f"dataset has {len(rows)} row(s): too few to hold some out; give heldout rows")
            rows, held = rows[:-count], rows[-count:]
            names["heldout"], names["heldout_start"] = names["train"], len(rows)
        else:
            held = _rows(heldout, names["heldout"])
        self._folder = self._folder or Path(tempfile.mkdtemp(prefix="distflow-rows-"))
        return (
            _write(rows, self._folder / "train.jsonl", names["train"], 0),
            _write(held, self._folder / "heldout.jsonl", names["heldout"], names["heldout_start"]),
            names,
        )

    def close(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)


def _holder(obj: object, key: str, nproc: int) -> tuple[str, str]:
    """(module, attribute) of the top-level variable holding `obj` that launched ranks import: the script's own
    (__main__) first, then the module of a function it holds (an Estimator's stage), then any imported module
    by name; a ConfigError when there is none."""
    fns = [value for value in vars(obj).values() if callable(value)] if hasattr(obj, "__dict__") else []
    modules = ["__main__", *(getattr(fn, "__module__", None) for fn in fns), *sorted(sys.modules)]
    for module_name in dict.fromkeys(modules):
        module = sys.modules.get(module_name or "")
        held = getattr(module, "__dict__", None) or {}  # a sys.modules entry may be None or a module-like object
        found = next((name for name, value in list(held.items()) if value is obj), None)
        if found is not None:
            return module_name, found
    raise ConfigError(
        f"{key} ({type(obj).__name__}) is held by no top-level variable of a module, so the {nproc} ranks that "
        f"nproc={nproc} starts cannot import it; assign it at the top level of a module, or train with nproc=1"
    )


def _rows(rows: Any, key: str) -> list[dict]:
    """The rows of a list of dicts or a datasets.Dataset (anything iterable giving dicts)."""
    if isinstance(rows, (str, bytes)) or not isinstance(rows, (Sequence,)) and not hasattr(rows, "column_names"):
        raise ConfigError(
            f"{key} must be a list of dicts or a datasets.Dataset (got {type(rows).__name__}); "
            "a file goes to task.train_file"
        )
    out = [dict(row) if isinstance(row, Mapping) else row for row in rows]
    bad = next((i for i, row in enumerate(out) if not isinstance(row, dict)), None)
    if bad is not None:
        raise ConfigError(f"{key}[{bad}] is not a dict (got {type(out[bad]).__name__})")
    if not out:
        raise ConfigError(f"{key} has no rows")
    return out


def _write(rows: list[dict], path: Path, key: str, start: int) -> str:
    """`path` holding `rows`, which the caller calls key[start], key[start + 1], ..."""
    lines = []
    for i, row in enumerate(rows, start):
        try:
            lines.append(json.dumps(row) + "\n")
        except TypeError as err:
            raise ConfigError(
                f"{key}[{i}] is not JSON-serializable ({err}); rows hold text, numbers, lists and dicts"
            ) from None
    path.write_text("".join(lines), encoding="utf-8")
    return str(path)


def _unique(names: list[str]) -> list[str]:
    """Metric names: the second `score` becomes `score_2`."""
    out: list[str] = []
    for name in names:
        candidate, n = name, 1
        while candidate in out:
            n += 1
            candidate = f"{name}_{n}"
        out.append(candidate)
    return out
