"""The shape of the package: import direction, no import cycles, small files and functions.

These are the rules docs/architecture.md states in prose; here they are checked, so
a change that breaks one says so in the suite rather than in a later review.
"""

import ast
import subprocess
import sys
from pathlib import Path

import distflow

PACKAGE = Path(distflow.__file__).parent
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


def _imports(tree: ast.Module, name: str) -> set[str]:
    """distflow modules this module imports, anywhere in it (function-level imports count,
    TYPE_CHECKING-only ones too: both are dependencies a reader follows)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("distflow"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("distflow"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m in _imports(tree, name) if m in modules and m != name} for name, tree in modules.items()}


def test_no_import_cycles():
    graph, state, cycles = _graph(), {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if dep == "distflow" or node == "distflow":
                continue
            if state.get(dep) == "open":
                cycles.append(path[path.index(dep) :] + [dep] if dep in path else [node, dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_only_the_entry_points_import_the_runtime():
    """The entry points are the CLI and the Python API (`distflow.train`, the CLI's engine)."""
    graph = _graph()
    outside = {
        name: sorted(dep for dep in deps if dep.startswith("distflow.runtime"))
        for name, deps in graph.items()
        if not name.startswith(("distflow.runtime", "distflow.cli", "distflow.api"))
    }
    assert {name: deps for name, deps in outside.items() if deps} == {}


def test_the_runtime_reaches_no_concrete_task_but_through_the_registry():
    """Nothing the runtime imports, directly or through other modules (function-level imports
    included), is a registered task's module: tasks are reached through `tasks/build.py`'s
    registry, by import path, only for the task a run uses."""
    from distflow.config.components import TASK_SOURCES

    graph = _graph()
    concrete = {spec.split(":")[0] for spec in TASK_SOURCES.builtins().values()}
    reached, todo = set(), [name for name in graph if name.startswith("distflow.runtime")]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(dep for dep in graph[name] if dep != "distflow")
    assert sorted(reached & concrete) == []
    assert "distflow.tasks.build" in reached  # the check above would pass vacuously without it


def test_files_are_small():
    lengths = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in lengths.items() if n > MAX_FILE_LINES} == {}


def test_functions_are_short_or_say_why():
    long = {}
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                doc = ast.get_docstring(node) or ""
                if length > MAX_FUNCTION_LINES and "long because" not in doc.lower():
                    long[f"{name}.{node.name}"] = length
    assert long == {}


def test_subprocess_hang_guards_in_tests_are_generous():
    """A test's `timeout=` on a subprocess only guards against a hang: a short one fails on a
    loaded machine (two such tests did, under a 2-core load of 10), so none is under 30 minutes."""
    import re

    tests = Path(__file__).parent
    short = {
        f"{path.name}:{number}": line.strip()
        for path in sorted(tests.glob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for value in re.findall(r"\btimeout=(\d+(?:\.\d+)?)\b", line)
        if float(value) < 1800
    }
    assert short == {}


LINTED = ("src", "tests", "benchmarks", "examples", "docs")


def test_lint_is_clean():
    """ruff's rules as pyproject.toml selects them (pyflakes, pycodestyle, isort, bugbear, pyupgrade)
    over every Python file of the repository: an import left behind by a refactor, a name that no
    longer exists, a `zip` of unequal lengths left unchecked, or a closure over a loop variable
    fails here instead of rotting."""
    root = PACKAGE.parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--quiet", *LINTED],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_code_is_formatted():
    """`ruff format` leaves every Python file unchanged (run it to fix this test)."""
    root = PACKAGE.parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", *LINTED],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout + done.stderr


BATCH_NAMES = ("batch", "micro", "mb", "expanded")  # what src/ calls a Batch


def test_every_batch_field_used_in_src_is_declared():
    """`batch["x"]`, `batch.updated(x=...)` and stage declarations name fields of data/fields.py only."""
    from distflow.data.fields import FIELDS

    used = {}
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.value, ast.Name)
                and node.value.id in BATCH_NAMES
                and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str)
            ):
                used.setdefault(node.slice.value, name)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "updated":
                used.update({k.arg: name for k in node.keywords if k.arg and k.arg not in used})
    assert len(used) > 15  # the scan sees the stages
    assert {field: module for field, module in used.items() if field not in FIELDS} == {}


MAX_FIELD_LITERALS_IN_DAG = 0


def test_stage_bodies_name_batch_fields_by_their_constants():
    """`batch[RESPONSE_MASK]`, not `batch["response_mask"]`: a subscript in dag/ by a string
    that is a declared field's name is counted, whatever is subscripted."""
    from distflow.data.fields import FIELDS

    counts = {}
    for path in sorted((PACKAGE / "dag").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        count = sum(
            isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in FIELDS
            for node in ast.walk(tree)
        )
        if count:
            counts[str(path.relative_to(PACKAGE))] = count
    assert sum(counts.values()) <= MAX_FIELD_LITERALS_IN_DAG, f"string literals naming batch fields: {counts}"


def test_every_engine_name_used_is_registered():
    """`uses=(...)` of every stage in src/ and `engines.get(...)` name trained models of the registry."""
    from distflow.config.components import TRAINED_MODELS

    used = {}
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "uses" and isinstance(node.value, (ast.Tuple, ast.List)):
                used.update({e.value: name for e in node.value.elts if isinstance(e, ast.Constant)})
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr == "engines"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                used[node.args[0].value] = name
    assert {"policy", "reference", "critic"} <= set(used)
    assert {engine: module for engine, module in used.items() if engine not in TRAINED_MODELS} == {}


LAYERS = (
    (
        "distflow.errors",
        "distflow.console",
        "distflow.envvars",
        "distflow.fileio",
        "distflow.seeding",
        "distflow.gc_policy",
        "distflow.comm",
    ),
    ("distflow.config",),
    ("distflow.layout",),
    ("distflow.algorithms", "distflow.data", "distflow.envs"),
    ("distflow.training", "distflow.scoring"),
    ("distflow.rollout", "distflow.sync", "distflow.engines"),
    ("distflow.checkpoint", "distflow.tasks", "distflow.observability", "distflow.agents"),
    ("distflow.dag", "distflow.planner"),
    ("distflow.preflight", "distflow.inputs"),
    ("distflow.runtime", "distflow.serve"),
    ("distflow.api", "distflow.cli", "distflow.cli_tools", "distflow.__main__", "distflow"),
)
"""Floors from the ground up (docs/architecture.md, "Layers"): a module imports its own floor and
those below, never one above (function-level and TYPE_CHECKING imports included)."""


def _layer(module: str) -> int:
    matches = [
        (len(prefix), floor)
        for floor, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} is on no floor of LAYERS: add it where it belongs"
    return max(matches)[1]


def test_no_import_climbs_a_layer():
    graph = _graph()
    climbs = sorted(
        f"{name} -> {dep}"
        for name, deps in graph.items()
        for dep in deps
        if dep != "distflow" and _layer(dep) > _layer(name)
    )
    assert climbs == []


MOVED_FROM_TRAINER = {
    old.split(".", 1)[1] for old in __import__("distflow.config.deprecated", fromlist=["MOVED"]).MOVED
}
SECTION_READERS = {
    "parallel": (
        "distflow.config",
        "distflow.training.registry",
        "distflow.rollout.auto",
        "distflow.rollout.compiled",
        "distflow.rollout.graphed",
        "distflow.rollout.engine",  # below float32 a rollout records its log-probs (`fields`)
        "distflow.planner.plan",
        "distflow.planner.memory_fit",  # the memory plan: strategy, dtypes, activation checkpointing
        "distflow.preflight",
        "distflow.runtime.executor",
        "distflow.runtime.worker",
        "distflow.runtime.start",
    ),
    "passes": ("distflow.config", "distflow.training.registry", "distflow.planner.memory_fit"),
    "watchdog": ("distflow.config", "distflow.runtime.faults", "distflow.runtime.executor"),
    "asynchronous": (
        "distflow.config",
        "distflow.planner.plan",
        "distflow.preflight",
        "distflow.runtime.executor",
        "distflow.dag.stages",
        "distflow.rollout.vllm",
    ),
}
"""The modules that may read a section of the config (`config.parallel`, `ctx.config.passes`, ...);
an engine gets its sections handed down by the registry (`self.parallel`, `self.passes`)."""


def _is_config(node: ast.expr) -> bool:
    """`config`, `cfg`, or `<anything>.config` (`ctx.config`, `worker.config`, `build.config`)."""
    return (
        isinstance(node, ast.Name)
        and node.id in ("config", "cfg")
        or isinstance(node, ast.Attribute)
        and node.attr in ("config", "cfg")
    )


def _config_reads(tree: ast.Module) -> list[tuple[str, str]]:
    """(section, key) of what `tree` reads: `config.<section>` as (section, ''), and `trainer.<key>` or
    `<...>.trainer.<key>` as ('trainer', key)."""
    reads = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if _is_config(node.value):
            reads.append((node.attr, ""))
        owner = node.value
        if (
            isinstance(owner, ast.Name)
            and owner.id == "trainer"
            or isinstance(owner, ast.Attribute)
            and owner.attr == "trainer"
        ):
            reads.append(("trainer", node.attr))
    return reads


def test_modules_read_only_the_config_sections_of_their_concern():
    """No module outside config/ reads a key that left `trainer` under its old name (`config.trainer.<key>`,
    or `trainer.<key>` through a local name), and the sections split from it are read only where they act."""
    old_names, outside = {}, {}
    for name, tree in _modules().items():
        if name.startswith("distflow.config"):
            continue
        for section, key in _config_reads(tree):
            if section == "trainer" and key in MOVED_FROM_TRAINER:
                old_names.setdefault(name, set()).add(f"trainer.{key}")
            elif section in SECTION_READERS and not name.startswith(SECTION_READERS[section]):
                outside.setdefault(name, set()).add(section)
    assert old_names == {}
    assert outside == {}


ENGINE_PACKAGES = (
    "distflow.training",
    "distflow.scoring",
    "distflow.sync",
    "distflow.rollout.decoding",
    "distflow.rollout.evaluation",
    "distflow.rollout.generation",
    "distflow.rollout.multiturn",
    "distflow.rollout.sampling",
    "distflow.rollout.vllm.",
)
"""What engines hold and use; the rollout components themselves (`rollout/engine.py`, `auto`, `compact`,
`compiled`, `graphed`, `generate`, `rollout/vllm/__init__.py`) are built from the `Config` by design
(config/components.py)."""


def test_engines_never_receive_the_whole_config():
    """Engines get the sections they need (`parallel=`, `passes=`, `OptimConfig`, a `LoraConfig`, a
    `SamplingSpec`); only the registry, which builds them, sees the `Config`."""
    takes_config = {}
    for name, tree in _modules().items():
        if not name.startswith(ENGINE_PACKAGES) or name == "distflow.training.registry":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in ("distflow.config", "distflow.config.schema"):
                takes_config.update(
                    {f"{name}: imports {a.name}": 1 for a in node.names if a.name in ("Config", "TrainerConfig")}
                )
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.args + node.args.kwonlyargs
                takes_config.update({f"{name}.{node.name}({a.arg})": 1 for a in args if a.arg in ("config", "trainer")})
    assert takes_config == {}


def test_max_staleness_is_read_only_where_it_acts():
    """`asynchronous.max_staleness` is validated (config/rules.py, the planner, preflight), chooses the
    pipelined loop (the executor, which hands it to runtime/pipelined.py), and decides what a rollout
    records (dag/stages.py), and where the vLLM engine runs (rollout/vllm/); everyone else is handed what
    they need."""
    readers = {
        name
        for name, tree in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "max_staleness"
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    }
    assert readers == {
        "distflow.config.rules",
        "distflow.planner.plan",
        "distflow.preflight",
        "distflow.runtime.executor",
        "distflow.dag.stages",
        "distflow.rollout.vllm",
    }


DEPRECATED_ALIASES = {
    "distflow.engines.registry": "distflow.training.registry",
    "distflow.engines.decoding": "distflow.rollout.decoding",
    "distflow.engines.sampling": "distflow.rollout.sampling",
}
"""The paths the docs once gave users, before `engines/` was split into training/, rollout/, scoring/ and sync/."""


def test_the_old_engines_paths_are_deprecated_aliases_only():
    """`distflow.engines` holds nothing but the aliases; nothing in src imports them; each re-exports its new
    module's names and warns once (a DeprecationWarning naming the new path)."""
    graph = _graph()
    assert sorted(name for name in graph if name.startswith("distflow.engines.")) == sorted(DEPRECATED_ALIASES)
    importers = [
        name
        for name, deps in graph.items()
        if not name.startswith("distflow.engines") and any(dep.startswith("distflow.engines") for dep in deps)
    ]
    assert importers == []
    check = (
        "import importlib, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    for old, new in {DEPRECATED_ALIASES!r}.items():\n"
        "        alias, module = importlib.import_module(old), importlib.import_module(new)\n"
        "        assert all(getattr(alias, n) is getattr(module, n) for n in alias.__all__), old\n"
        "        importlib.import_module(old)\n"
        "print(sorted(str(w.message).split()[0] for w in caught if w.category is DeprecationWarning))\n"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(sorted(DEPRECATED_ALIASES))
