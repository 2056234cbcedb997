"""Before any rank starts: the run's parts (config/parts.py) with what the graph adds, their trained models'
rules and every part's `preflight`."""

from __future__ import annotations

from collections.abc import Iterable

from distflow.config.schema import Config, ConfigError


def run_parts(config: Config, uses: Iterable[str]) -> tuple:
    """The run's parts (config/parts.py): `parts(config)`, then the agent or environment (when set) and the
    trained models the stages `uses`, each imported now."""
    from distflow.config.callables import agent_function
    from distflow.config.components import TRAINED_MODELS
    from distflow.config.parts import Part, parts

    found = list(parts(config))
    if config.rollout.agent is not None:
        agent = agent_function(config.rollout.agent)
        found.append(Part("rollout.agent", config.rollout.agent, "agent", agent, origin=config.rollout.agent))
    if config.env.cls is not None:
        from distflow.envs import environment_class

        env = environment_class(config.env.cls, kwargs=config.env.kwargs)
        found.append(Part("env.cls", config.env.cls, "environment", env, origin=config.env.cls))
    for name in dict.fromkeys(uses):
        origin = TRAINED_MODELS.builtins().get(name, name)
        found.append(Part("uses", name, TRAINED_MODELS.kind, TRAINED_MODELS.get(name), origin=origin))
    return tuple(found)


def check_parts(config: Config, uses: Iterable[str]) -> None:
    """The trained models' rules (`check`: the other parts' ran at config load), then what this machine lacks
    for each part of the run (its `preflight`: vLLM must import, a task source's library, an installed
    environment), over the parts list (`run_parts`: the agent or environment and the trained
    models the stages `uses` are imported here). The first problem is the one line."""
    from distflow.config.parts import check_all, preflight_problems

    found = run_parts(config, uses)
    check_all([part for part in found if part.key == "uses"], config)
    problems = preflight_problems(found, config)
    if problems:
        raise ConfigError(problems[0])
