"""One door for every swappable part: a registry per kind, one convention for all of them.

    config section ──names──► Registry.get(name) ──► the component class
        `rollout: {engine: vllm, vllm: {log: true}}`     built-in: a name, imported only when chosen
        `rollout: {engine: 'mypkg.engines:Sglang'}`      a user's own: `module:name`, imported and
                                                         registered under that spelling
    the component class ──owns──► its `Config` (the section's `<name>: {...}` or `options:`), the rules
        it needs of the other sections (`check`), what it adds to a batch (`fields`), what this machine
        must have (`preflight`), and `build(...)`; an instance's `state_dict()` is what checkpoints keep
        of it (`load_state_dict` on resume), its `close()` ends what it holds

Where a kind's parts are plain functions (a policy loss, a KL estimator, an off-policy correction),
its `FunctionRegistry` gives the function itself: `POLICY_LOSSES[algo.policy_loss](logp_BR, ...)`. The
settings that name a part of the algorithm are checked when the config is loaded (`check_name`). A trained
model (`TRAINED_MODELS`) is named by a stage's `uses` instead, and checked with the graph (dag/graph.py).

Each registry holds its kind's `Contract` (config/callables.py): a part of yours, `module:name` or
registered, is checked against it when it is first imported (its signature or its base class: one line
naming the key, exit 2), and a function part's tensors at each call (policy losses, KL estimators and
off-policy weights return their first argument's shape).

The built-ins are import paths, not references, on purpose: the config layer names them without
importing the layers above it, and a component's own dependencies (vLLM, datasets, reasoning-gym)
load only in the runs that choose it. A component module therefore imports torch inside its
functions: checking a config and `distflow plan` must not pay for it.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

from distflow.config.callables import Contract, import_part
from distflow.config.errors import ConfigError
from distflow.config.parse import build


class Component:
    """What every swappable part declares; a kind's base class (rollout engines: `distflow.rollout`)
    adds the kind's own methods. Every hook has a default, so a part declares only what it needs."""

    name: ClassVar[str] = ""
    Config: ClassVar[type | None] = None
    """Its options, a kw-only dataclass validated in `__post_init__`; None: it takes none."""

    @classmethod
    def options(cls, raw: dict, where: str) -> Any:
        """`raw` (what the section gives under the part's name or `options`) as its `Config`."""
        if cls.Config is None:
            if raw:
                raise ConfigError(f"{where}: {cls.name or cls.__name__} takes no options (got {sorted(raw)})")
            return None
        return build(cls.Config, raw, where)

    @classmethod
    def implied(cls) -> dict[str, Any]:
        """Settings it implies where the config leaves them unset, by dotted key (set by config/loader.py)."""
        return {}

    @classmethod
    def check(cls, config: Any) -> None:
        """The rules it needs of the other sections of the run's `config`; a `ConfigError` each."""

    @classmethod
    def fields(cls, config: Any) -> tuple[str, ...]:
        """The batch fields it adds where it runs (beyond what its stage declares for every part)."""
        return ()

    @classmethod
    def preflight(cls, config: Any) -> list[str]:
        """What this machine lacks for it, one line each (run before anything loads)."""
        return []

    @classmethod
    def process_environment(cls, config: Any) -> dict[str, str]:
        """Variables it needs set in each rank's process before torch loads (unless the user set them)."""
        return {}

    def state_dict(self) -> dict:
        """What the instance keeps across a resume: JSON values, the same on every rank (checkpoint/parts.py)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Take back what `state_dict` gave, on resume (not called when the checkpoint holds nothing of it)."""

    def close(self) -> None:
        """End what the instance holds (threads, child processes, files)."""


class Registry:
    """Name → component class of one kind (`kind`, chosen by config key `key`); a user's part must meet
    `contract` (None: any)."""

    def __init__(self, kind: str, key: str, builtins: dict[str, str], contract: Contract | None = None) -> None:
        self.kind, self.key, self.contract = kind, key, contract
        self._paths = dict(builtins)  # name -> "module:attr", imported when first chosen
        self._classes: dict[str, type] = {}

    def names(self) -> list[str]:
        return list(dict.fromkeys([*self._paths, *self._classes]))

    def builtins(self) -> dict[str, str]:
        """Built-in name → its `module:attr`."""
        return dict(self._paths)

    def register(self, cls: Any, name: str | None = None) -> Any:
        """Add `cls` (a component class, or an instance where a kind's parts are values: an `Estimator`)
        under `name` (default: `cls.name`); the same name for another is a ConfigError. Usable as a class
        decorator."""
        name = name or cls.name
        if self.contract is not None:
            self.contract.check_part(cls, f"{self.key}={name!r}", self.kind)
        known = self._classes.get(name)
        if name in self._paths and (known is None or _origin(known) != _origin(cls)):  # imported or not yet
            raise ConfigError(f"{self.kind} {name!r} is a built-in one; choose another name")
        if known is not None and _origin(known) != _origin(cls):
            raise ConfigError(f"{self.kind} {name!r} is registered twice; choose another name")
        self._classes[name] = cls
        return cls

    def get(self, name: str) -> type:
        """The component named `name`: registered, built in, or `module:attr` (imported now). A plain
        function there is the kind's `build` (`FunctionComponent`)."""
        if name in self._classes:
            return self._classes[name]
        path = self._paths.get(name) or (name if ":" in name else None)
        if path is None:
            raise ConfigError(
                f"{self.key}={name!r} is not a {self.kind}; choose one of {', '.join(self.names())}, "
                f"or name your own as 'package.module:name'"
            )
        is_given, found = import_part(path, f"{self.key}={name!r}")
        if self.contract is not None and name not in self._paths:  # yours: checked once, when first imported
            self.contract.check_part(found, f"{self.key}={name!r}", self.kind)
        if inspect.isfunction(found):
            found = function_component(found, name)
        self._classes.update({} if is_given else {name: found})  # a given object is its run's: not kept
        return found

    def __getitem__(self, name: str) -> Any:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def __iter__(self):
        """The names a config gives plainly: the built-ins, then those registered (not a `module:name`)."""
        return iter([name for name in self.names() if ":" not in name])

    def values(self) -> list:
        """The parts `iter(self)` names, each imported now."""
        return [self.get(name) for name in self]

    def check_name(self, name: str) -> None:
        """At config load: `name` is one of this kind's, built in (not imported here: only a run that uses it
        pays for its module's imports, torch among them) or registered, or your `module:name`, imported now,
        so that a wrong one is one line before anything starts."""
        if name in self._paths or name in self._classes:
            return
        if ":" not in name:
            raise ConfigError(
                f"{self.key} must be one of: {', '.join(n for n in self.names() if ':' not in n)} (got {name!r}); "
                "or name your own as 'package.module:name'"
            )
        self.get(name)

    def chosen(self, section: Any, selector: str) -> tuple[type, Any]:
        """(the component `section.<selector>` names, its options from `section.options`)."""
        name = getattr(section, selector)
        cls = self.get(name)
        return cls, cls.options(section.options, f"{self.key.rsplit('.', 1)[0]}.{_label(name)}")


def function_component(fn: Any, name: str) -> type:
    """A component whose `build(*args)` is `fn(*args)` and whose options are the section's `options` as
    given (a plain dict): the door for a part that is one function (`task.source: 'mymod:rows'`)."""

    class FunctionComponent(Component):
        @classmethod
        def options(cls, raw: dict, where: str) -> dict:
            return dict(raw)

        @classmethod
        def build(cls, *args: Any) -> Any:
            return fn(*args)

    FunctionComponent.name = name
    FunctionComponent.function = staticmethod(fn)  # what `FunctionRegistry.get` gives back
    FunctionComponent.__qualname__ = f"FunctionComponent[{name}]"
    FunctionComponent.__module__ = getattr(fn, "__module__", "")
    return FunctionComponent


class FunctionRegistry(Registry):
    """A kind whose parts are functions (a policy loss, a KL estimator, an off-policy correction): `get`, and
    `[name]`, give the function itself, a built-in's or your `module:name`'s, so that a call site reads
    `KL_ESTIMATORS[name](logp_BR, ref_logp_BR)`. Register your own with `register(fn, name)`."""

    def get(self, name: str) -> Any:
        part = super().get(name)
        part = getattr(part, "function", part)  # a plain function comes back wrapped (`function_component`)
        if not callable(part):
            raise ConfigError(f"{self.key}={name!r} is a {type(part).__name__}, not a function")
        if inspect.isfunction(part) and self.contract is not None:  # its outputs checked at each call
            return self.contract.checked(part, f"{self.key}={name!r}", self.kind)
        return part


def _label(name: str) -> str:
    return name if ":" not in name else "options"


def _origin(cls: type) -> tuple[str, str]:
    return getattr(cls, "__module__", ""), getattr(cls, "__qualname__", repr(cls))


ALGORITHMS = Registry(
    "algorithm",
    "algorithm.name",
    {
        "grpo": "distflow.config.algorithm:GRPO",
        "dr_grpo": "distflow.config.algorithm:DR_GRPO",
        "dapo": "distflow.config.algorithm:DAPO",
        "rloo": "distflow.config.algorithm:RLOO",
        "reinforce_pp": "distflow.config.algorithm:REINFORCE_PP",
        "reinforce_pp_baseline": "distflow.config.algorithm:REINFORCE_PP_BASELINE",
        "remax": "distflow.config.algorithm:REMAX",
        "gspo": "distflow.config.algorithm:GSPO",
        "ppo": "distflow.config.algorithm:PPO",
    },
    Contract(
        "a distflow.config.algorithm.AlgorithmPreset",
        base="distflow.config.algorithm:AlgorithmPreset",
    ),
)
"""The algorithm presets (config/algorithm.py): an `AlgorithmPreset` each, the estimator and the values the
null settings of `algorithm` take; your own is `algorithm.name: 'package.module:NAME'`, an `AlgorithmPreset`."""

ROLLOUT_ENGINES = Registry(
    "rollout engine",
    "rollout.engine",
    {
        "auto": "distflow.rollout.auto:AutoEngine",
        "compact": "distflow.rollout.compact:CompactEngine",
        "compiled": "distflow.rollout.compiled:CompiledEngine",
        "generate": "distflow.rollout.hf_generate:GenerateEngine",
        "graphed": "distflow.rollout.graphed:GraphedEngine",
        "vllm": "distflow.rollout.vllm:VllmRollout",
    },
    Contract(
        "a distflow.rollout.engine.RolloutEngine subclass, whose responses(model, request) returns "
        "(response ids [G·n, R], their log-probs or None)",
        base="distflow.rollout.engine:RolloutEngine",
    ),
)
"""The rollout engines (distflow/rollout/); a user's own is `rollout.engine: 'package.module:Class'`."""

TRAINED_MODELS = Registry(
    "trained model",
    "Stage.uses",
    {
        "critic": "distflow.training.registry:Critic",
        "model": "distflow.training.registry:Model",
        "reference": "distflow.training.registry:Reference",
        "policy": "distflow.training.registry:Policy",
    },
    Contract(
        "a distflow.training.registry.TrainedModel subclass",
        base="distflow.training.registry:TrainedModel",
    ),
)
"""What a stage names in `uses` and a rank builds for it (training/registry.py): each a
`distflow.training.registry.TrainedModel`. Named by a stage, not by a config section: your own is
`uses=('package.module:Class',)`, or a name registered with `TRAINED_MODELS.register(cls)`. The order here is
the build order where `after` leaves a choice (`build_order`): critic, model (LoRA adapters), reference, policy."""

TASK_SOURCES = Registry(
    "task source",
    "task.source",
    {
        "arithmetic": "distflow.tasks.arithmetic:Arithmetic",
        "files": "distflow.tasks.math_answers:Files",
        "datasets": "distflow.tasks.math_answers:Datasets",
        "reasoning_gym": "distflow.tasks.reasoning_gym:ReasoningGym",
        "verifiers": "distflow.tasks.verifiers:Verifiers",
    },
    Contract(
        "a distflow.tasks.build.TaskSource subclass, or a function (config, tokenizer) -> Task (train, heldout, "
        "required_fields, is_correct)",
        params=("config", "tokenizer"),
        base="distflow.tasks.build:TaskSource",
    ),
)
"""Where a run's rows come from (distflow/tasks/); your own is `task.source: 'package.module:name'`."""

ESTIMATORS = Registry(
    "advantage estimator",
    "algorithm.estimator",
    {
        "grpo": "distflow.dag.estimators:GRPO",
        "rloo": "distflow.dag.estimators:RLOO",
        "remax": "distflow.dag.estimators:REMAX",
        "reinforce_pp": "distflow.dag.estimators:REINFORCE_PP",
        "reinforce_pp_baseline": "distflow.dag.estimators:REINFORCE_PP_BASELINE",
        "gae": "distflow.dag.estimators:GAE",
    },
    Contract("a distflow.dag.pieces.Estimator", base="distflow.dag.pieces:Estimator"),
)
"""The advantage estimators (dag/estimators.py); your own is `algorithm.estimator: 'package.module:NAME'`,
a `distflow.dag.pieces.Estimator` that may declare stages of its own."""

POLICY_LOSSES = FunctionRegistry(
    "policy loss",
    "algorithm.policy_loss",
    {
        "ppo": "distflow.algorithms.policy_losses:ppo_policy_loss",
        "gspo": "distflow.algorithms.policy_losses:gspo_policy_loss",
    },
    Contract(
        "fn(logp_BR, old_logp_BR, advantage, mask_BR, algo) -> (loss_BR, clipped_BR), both [B, R] as logp_BR",
        params=("logp_BR", "old_logp_BR", "advantage", "mask_BR", "algo"),
        returns=2,
    ),
)
"""The policy losses (algorithms/policy_losses.py, over algorithms/losses.py); your own is `algorithm.policy_loss:
'package.module:function'`: an unreduced per-token loss and the tokens it clipped, `advantage` per sequence
`[B]` or per token `[B, R]`, `algo` the `algorithm` section."""

KL_ESTIMATORS = FunctionRegistry(
    "KL estimator",
    "algorithm.kl.estimator",
    {
        "k1": "distflow.algorithms.kl:kl_k1",
        "k2": "distflow.algorithms.kl:kl_k2",
        "k3": "distflow.algorithms.kl:kl_k3",
        "abs": "distflow.algorithms.kl:kl_abs",
        "k1+": "distflow.algorithms.kl:kl_k1_plus",
        "k3+": "distflow.algorithms.kl:kl_k3_plus",
    },
    Contract(
        "fn(logp_BR, ref_logp_BR) -> kl_BR, [B, R] as logp_BR",
        params=("logp_BR", "ref_logp_BR"),
        returns=1,
    ),
)
"""The per-token KL(π‖π_ref) estimators (algorithms/kl.py); yours is `algorithm.kl.estimator: 'package.module:fn'`."""

OFF_POLICY_CORRECTIONS = FunctionRegistry(
    "off-policy correction",
    "algorithm.off_policy_correction",
    {
        "none": "distflow.algorithms.off_policy:NONE",
        "tis": "distflow.algorithms.off_policy:TIS",
        "mask": "distflow.algorithms.off_policy:MASK",
        "seq_tis": "distflow.algorithms.off_policy:SEQ_TIS",
        "seq_mask": "distflow.algorithms.off_policy:SEQ_MASK",
        "geo_tis": "distflow.algorithms.off_policy:GEO_TIS",
        "geo_mask": "distflow.algorithms.off_policy:GEO_MASK",
    },
    Contract(
        "a distflow.algorithms.off_policy.OffPolicyCorrection, or a function (ratio_BR, cap) -> weight_BR, [B, R] "
        "as ratio_BR",
        params=("ratio_BR", "cap"),
        base="distflow.algorithms.off_policy:OffPolicyCorrection",
        returns=1,
    ),
)
"""The importance weights of stale samples (algorithms/off_policy.py): each an `OffPolicyCorrection`, which
declares the batch fields it needs (`fields`) and corrects the loss, and which, called, is its weight function
`(ratio_BR, cap) -> weight_BR`. Yours is `algorithm.off_policy_correction: 'package.module:name'`, such a
function (the weight of each token from its proximal/behaviour ratio and `algorithm.off_policy_cap`) or an
`OffPolicyCorrection`."""

LOSS_AGGREGATIONS = Registry(
    "loss aggregation",
    "algorithm.loss_agg",
    {
        "token-mean": "distflow.algorithms.aggregation:TokenMean",
        "token-sum": "distflow.algorithms.aggregation:TokenSum",
        "seq-mean-token-sum": "distflow.algorithms.aggregation:SeqMeanTokenSum",
        "seq-mean-token-mean": "distflow.algorithms.aggregation:SeqMeanTokenMean",
        "seq-mean-token-sum-norm": "distflow.algorithms.aggregation:SeqMeanTokenSumNorm",
    },
    Contract(
        "a distflow.algorithms.aggregation.TokenMean subclass (its loss_sum, normalizer and finish)",
        base="distflow.algorithms.aggregation:TokenMean",
    ),
)
"""How a per-token loss becomes the scalar back-propagated (algorithms/aggregation.py); your own is
`algorithm.loss_agg: 'package.module:Class'`."""
