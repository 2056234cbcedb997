"""What a run is made of, resolved once: `parts(config)`, an ordered list of (key, part, options).

    config ──parts()──► rollout.engine                  a RolloutEngine class, its options (`rollout.<name>:`)
                        task.source                     a TaskSource class (or your function), its options
                        algorithm.estimator             an Estimator (the algorithm preset's, or yours)
                        algorithm.policy_loss           a function
                        algorithm.kl.estimator          a function
                        algorithm.off_policy_correction an OffPolicyCorrection (or your function)
                        algorithm.loss_agg              a TokenMean class
           preflight.run_parts(config, uses) adds, once the graph is built (the process that starts a run, `plan`):
                        rollout.agent / env.cls         the agent function or the environment class, when set
                        uses=<name>                     each trained model a stage uses (its TrainedModel class)

Every hook a component declares (config/components.py: `Component`) is called over this list, not per kind:

    implied              before the sections are built (config/loader.py): the engine's and the task source's
    check                config load (rules.check_sections); the trained models' where the graph is (`run_parts`)
    preflight            before any rank starts (runtime/start.py's `validate`)
    process_environment  each rank's variables, before torch loads (runtime/start.py): the parts of `parts(config)`
    fields               the rollout stage's batch fields (dag/stages.py's `behaviour_fields`): the parts that run
                         in the rollout (the engine, the correction whose ratio it records; a plain function
                         correction needs `rollout_logp`, as `OffPolicyCorrection.named` makes it)
    state_dict, close    the instances a rank holds (runtime/checkpointing.py, runtime/worker.py): the engine's
                         and the task's

A part whose kind has no place to run a hook it declares is refused at load, in one line (`refuse_unrun`): the
implied settings of a correction or a trained model, a task source's batch fields (its rows reach the batch
through the loader), the state or close of a correction (a weight function, never an instance a rank keeps),
of a trained model (checkpoints keep `trained_state`), and a trained model's process environment (its class is
imported with the graph, after the variables are set).
Parts that are not components (functions, estimators, aggregations, agents, environments) declare no hooks.
`distflow plan` prints the list (`describe_parts`). Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from distflow.config.components import (
    ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    OFF_POLICY_CORRECTIONS,
    POLICY_LOSSES,
    ROLLOUT_ENGINES,
    TASK_SOURCES,
    Component,
)
from distflow.config.errors import ConfigError

ROLLOUT_KINDS = ("rollout engine", "off-policy correction")
"""The kinds whose batch fields (`fields`) the rollout stage records."""
IMPLYING = ("rollout engine", "task source")
"""The kinds whose implied settings (`implied`) the loader sets (config/loader.py's `apply_implied`)."""
INSTANCE_HOOKS = ("state_dict", "load_state_dict", "close")
HELD = ("rollout engine", "task source")
"""The kinds whose instances a rank holds, checkpoints (`state_dict`) and closes."""


@dataclass(frozen=True)
class Part:
    key: str
    """The config key that chose it: `rollout.engine`, `algorithm.policy_loss`, `uses` for a trained model."""
    name: str
    """Its name there: a built-in's, or your `package.module:name`."""
    kind: str
    part: Any
    """The class, function or value the name resolves to."""
    options: Any = None
    """Its typed options (the component's `Config`), None where it takes none."""
    origin: str = ""
    """Where it is defined, `module:attr` (a built-in's registry entry; yours is its name)."""

    @property
    def component(self) -> bool:
        """Whether it declares hooks: a `Component` subclass or instance."""
        part = self.part
        return isinstance(part, Component) or (isinstance(part, type) and issubclass(part, Component))

    def declares(self, hook: str) -> bool:
        """Whether it overrides `Component`'s default `hook` (the default does nothing)."""
        return self.component and declares(self.part, hook)

    def hook(self, hook: str):
        """Its `hook` (bound: a classmethod, or an instance's method), None for a part that is no component."""
        return getattr(self.part, hook) if self.component else None


def declares(component: Any, hook: str) -> bool:
    """Whether `component` (a Component class or instance) overrides `Component`'s default `hook`."""
    cls = component if isinstance(component, type) else type(component)
    return next((c for c in cls.__mro__ if hook in vars(c)), Component) is not Component


def parts(config: Any) -> tuple[Part, ...]:
    """The parts `config` chooses, in the order of the module docstring; each resolved now (a user's imported)."""
    algo = config.algorithm
    engine, engine_options = ROLLOUT_ENGINES.chosen(config.rollout, "engine")
    source, source_options = TASK_SOURCES.chosen(config.task, "source")
    chosen = (
        ("rollout.engine", config.rollout.engine, ROLLOUT_ENGINES, engine, engine_options),
        ("task.source", config.task.source, TASK_SOURCES, source, source_options),
        ("algorithm.estimator", algo.estimator, ESTIMATORS, ESTIMATORS.get(algo.estimator), None),
        ("algorithm.policy_loss", algo.policy_loss, POLICY_LOSSES, POLICY_LOSSES.get(algo.policy_loss), None),
        ("algorithm.kl.estimator", algo.kl.estimator, KL_ESTIMATORS, KL_ESTIMATORS.get(algo.kl.estimator), None),
        (
            "algorithm.off_policy_correction",
            algo.off_policy_correction,
            OFF_POLICY_CORRECTIONS,
            OFF_POLICY_CORRECTIONS.get(algo.off_policy_correction),
            None,
        ),
        ("algorithm.loss_agg", algo.loss_agg, LOSS_AGGREGATIONS, LOSS_AGGREGATIONS.get(algo.loss_agg), None),
    )
    return tuple(
        Part(key, name, registry.kind, part, options, registry.builtins().get(name, name))
        for key, name, registry, part, options in chosen
    )


def refuse_unrun(found: Iterable[Part]) -> None:
    """One line for a part that declares a hook its kind has no place to run (the module docstring's list)."""
    for part in found:
        where = f"{part.key}={part.name}" if part.key != "uses" else f"the trained model {part.name}"
        if part.kind not in ROLLOUT_KINDS and part.declares("fields"):
            raise ConfigError(
                f"{where} declares batch fields (`fields`), which only the rollout's parts (its engine, the "
                f"off-policy correction) add: a {part.kind}'s reach the batch otherwise; remove its `fields`"
            )
        if part.kind not in IMPLYING and part.declares("implied"):
            raise ConfigError(
                f"{where} declares implied settings, which only a rollout engine and a task source give (the "
                "loader reads those two before the sections are built); set those settings in the config"
            )
        if part.key == "uses" and part.declares("process_environment"):
            raise ConfigError(
                f"{where} declares process_environment, which runs before the graph names the trained models "
                "(and before torch loads): set those variables in the environment that starts the run"
            )
        held = [hook for hook in INSTANCE_HOOKS if part.declares(hook)]
        if part.kind not in HELD and held:
            raise ConfigError(
                f"{where} declares {', '.join(held)}, but no rank holds an instance of a {part.kind} to "
                "checkpoint or close (a rollout engine's or a task's would be); remove them"
            )


def check_all(found: Iterable[Part], config: Any) -> None:
    """Each part's rules of the other sections (`check`), in the list's order; then `refuse_unrun`."""
    found = tuple(found)
    for part in found:
        if part.component:
            part.hook("check")(config)
    refuse_unrun(found)


def preflight_problems(found: Iterable[Part], config: Any) -> list[str]:
    """What this machine lacks for the parts (each one's `preflight`), in the list's order."""
    return [line for part in found if part.component for line in part.hook("preflight")(config)]


def process_environment(found: Iterable[Part], config: Any) -> dict[str, str]:
    """The variables the parts need in each rank's process (the first part that names one sets it)."""
    variables: dict[str, str] = {}
    for part in found:
        if part.component:
            for name, value in part.hook("process_environment")(config).items():
                variables.setdefault(name, value)
    return variables


def rollout_fields(found: Iterable[Part], config: Any) -> tuple[str, ...]:
    """The batch fields the rollout's parts declare it records (`fields`: the engine's, the correction's)."""
    return tuple(
        name for part in found if part.component and part.kind in ROLLOUT_KINDS for name in part.hook("fields")(config)
    )


def describe_parts(found: Iterable[Part]) -> str:
    """The list as `distflow plan` prints it: a line a part, its key, its name, its kind, where it is defined,
    and its options."""
    lines = ["parts:"]
    for part in found:
        key = part.key if part.key != "uses" else "stage uses"
        options = f"  {part.options}" if part.options not in (None, {}) else ""
        lines.append(f"  {key:<32} {part.name:<20} {part.kind} ({part.origin}){options}")
    return "\n".join(lines)
