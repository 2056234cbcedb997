"""The `vllm` rollout engine: each rank that rolls out owns a vLLM engine, in its process or in a child.

    colocated and synchronous (every rank rolls out,        otherwise (disaggregated placement, or
    asynchronous.max_staleness=0): in the rank's process    max_staleness > 0): the engine core in a child
    ┌ rank r ─────────────────────────────────────┐         ┌ rank r ────────────────┐   ┌ child (spawned) ─┐
    │ rollout model ──its tensors──► vLLM model   │         │ rollout model ──copy──►│──►│ vLLM engine core │
    │ prompts ──► LLM.generate ──► ids, log-probs │         │ /dev/shm file, rpc     │   │ + its worker:    │
    └─────────────────────────────────────────────┘         │ prompts ──► generate ◄─│◄──│ the vLLM model   │
                                                            └────────────────────────┘   └──────────────────┘
    both: new weights announced by `VllmRollout.update_weights(model, version)` (an optimizer step, a
    weight sync, a resume: dag/context.py's `Engines.new_weights`), which only keeps the version; the push
    is deferred to the start of the next rollout and made there when the engine holds another version
    (the first rollout always: the engine starts from dummy weights), through one loader
    (rollout/vllm/worker.py); one request per sample, seed = f(key); no server, no router

Which mode: `VllmRollout.in_child`, decided once per run by `distflow.rollout.vllm.in_child(config)`.
In the rank's process (V1 multiprocessing off, `VLLM_ENABLE_V1_MULTIPROCESSING=0`) the model takes the
policy's tensors directly, as TRL's colocate mode does; but vLLM then builds its process groups over
torch's default group, so making the engine is a collective of the whole world, and every rank must
make it at the same point: only when every rank rolls out in lockstep. Otherwise the engine core runs
in a child process of the rank (`VLLM_ENABLE_V1_MULTIPROCESSING=1`, started by spawn, not fork, so it
does not inherit the rank's torch.distributed state and builds a world of its own), made by this rank
alone; its weights go through a shared-memory file (worker.SharedWeights); the run's end closes it
(`close_engines`, from the worker's close) and the rank's death, kill -9 included, ends it
(worker.PolicyWeights.watch_owner).
A push is local (no collective): under fsdp2 it runs inside `gathered`, where every rank holds the
whole model (the reason it waits for the rollout: an update is announced outside, on the shards), and
once per announced version, not at every rollout although gathering hands it new tensors each time.
Several versions announced between two rollouts cost one push. Nothing watches the tensors: weights
written without an announcement are not pushed. Both start from dummy weights (`load_format=dummy`)
and get the policy's before their first generation, so any model the policy holds (a warm-start, a
checkpoint, LoRA merged) is what they sample from, with no model directory read twice.

Samples: each request's seed is derived from the sample's key (the same (seed, uid) key the other
engines draw from), so a sample does not depend on its rank, batch-mates or the engine's mode; vLLM's
sampler is not distflow's keyed inverse-CDF sampler, so `vllm` samples differ from `compact`'s, and two
vLLM runs agree up to kernel numerics (a different batch composition can change a float rounding).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import weakref
from collections.abc import Iterator

import torch

import distflow.rollout.vllm.logs as vllm_logs
from distflow.rollout.vllm.queues import EngineQueues, remove_stale
from distflow.rollout.vllm.weights import hf_named_weights
from distflow.rollout.vllm.worker import SharedWeights

SEED_MASK = 2**63 - 1
SHUTDOWN_GRACE_S = 120.0
"""How long a child engine gets to end by itself at the end of a run before vLLM kills it."""
MAX_MODEL_LEN = 4096
"""The longest sequence an engine accepts (the model's own limit if smaller); the KV cache must hold one."""


def request_seed(key: int) -> int:
    """vLLM's per-request seed for a sample key (non-negative, 63 bits).

    >>> request_seed(5), request_seed(-1) == 2**63 - 1
    (5, True)
    """
    return key & SEED_MASK


def padded_responses(
    token_ids: list[list[int]], logprobs: list[list[float]] | None, *, width: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(response ids [B, width] right-padded with `pad_id`, log-probs [B, width] with 0 after each row's
    end) from vLLM's per-request outputs; a row longer than `width` is cut.

    >>> ids, logp = padded_responses([[5, 2], [7]], [[-0.5, -0.25], [-1.0]], width=3, pad_id=0)
    >>> ids.tolist(), logp.tolist()
    ([[5, 2, 0], [7, 0, 0]], [[-0.5, -0.25, 0.0], [-1.0, 0.0, 0.0]])
    """
    ids_BR = torch.full((len(token_ids), width), pad_id, dtype=torch.long)
    logp_BR = torch.zeros((len(token_ids), width), dtype=torch.float32) if logprobs is not None else None
    for b, row in enumerate(token_ids):
        row = list(row)[:width]
        ids_BR[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        if logp_BR is not None:
            logp_BR[b, : len(row)] = torch.tensor(list(logprobs[b])[: len(row)], dtype=torch.float32)
    return ids_BR, logp_BR


TORCH_LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)
"""The rank's place in the torch world (torchrun's variables): a child engine is not part of that world."""


def _mode_environment(in_child: bool, device: torch.device) -> tuple[dict[str, str], tuple[str, ...]]:
    """(variables to set, variables to remove) while an engine is made: vLLM reads its mode from the
    environment, and a child engine inherits the rest (it must not see the rank's torch world; on CUDA it
    sees the rank's device alone, as its device 0)."""
    if not in_child:
        # vLLM's CPU worker drops torch to one thread "for serving" unless OMP_NUM_THREADS is set: in the
        # rank's own process that would leave the rank's update on one core, so it is told the rank's count.
        keep = {"OMP_NUM_THREADS": str(torch.get_num_threads())} if device.type == "cpu" else {}
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **({} if "OMP_NUM_THREADS" in os.environ else keep)}, ()
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    if device.type == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        env["CUDA_VISIBLE_DEVICES"] = ids[device.index or 0]
    return env, TORCH_LAUNCH_VARS


@contextlib.contextmanager
def _environment(set_vars: dict[str, str], removed: tuple[str, ...]) -> Iterator[None]:
    """os.environ with `set_vars` set and `removed` removed, put back as it was on the way out."""
    saved = {name: os.environ.get(name) for name in (*set_vars, *removed)}
    os.environ.update(set_vars)
    for name in removed:
        os.environ.pop(name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _whole_prompts(max_len: int) -> dict:
    """Off CUDA, every prompt prefilled in one engine step: chunked prefill off, a step's token budget
    at least the longest sequence. A step that prefills part of a prompt still samples a token for it
    and throws it away, then winds the request's generator back: vLLM does that by the generator's
    offset, which only CUDA generators have (on the CPU it raised "CPU Generator does not use
    offset" as soon as a batch's prompts passed the budget, 4,096 tokens by default on the CPU: an evaluation of
    200 prompts). Without chunks no token is thrown away, so a seeded request's draws do not depend
    on the batch around it."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_len, 4096)}


class VllmEngine:
    """One rank's vLLM engine for one rollout model, with that model's weights loaded; its core in this
    process or (`in_child`) in a child process. `log`: vLLM's own log shown (rollout/vllm/logs.py); by
    default one line of distflow's per engine start."""

    def __init__(self, model: torch.nn.Module, *, in_child: bool, log: bool = False) -> None:
        quiet = vllm_logs.quiet(log)
        if quiet:
            vllm_logs.quiet_this_process()
        from vllm import LLM
        from vllm.v1.engine.core_client import InprocClient

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: vLLM's CPU default (4) is much for a test box
        if in_child:  # the queues of engines whose rank and processes were all killed (rollout/vllm/queues.py)
            remove_stale()
        inner = getattr(model, "module", model)
        config = inner.get_base_model().config if hasattr(inner, "get_base_model") else inner.config
        first = next(inner.parameters())
        cuda = first.device.type == "cuda"
        max_len = min(getattr(config, "max_position_embeddings", MAX_MODEL_LEN) or MAX_MODEL_LEN, MAX_MODEL_LEN)
        extra = {"gpu_memory_utilization": 0.3, "enable_sleep_mode": False} if cuda else _whole_prompts(max_len)
        set_num_threads = torch.set_num_threads  # vLLM's CPU worker stubs it out in the process it runs in
        with tempfile.TemporaryDirectory(prefix="distflow-vllm-") as config_dir:
            config.save_pretrained(config_dir)  # the architecture only: weights come from the policy
            set_vars, removed = _mode_environment(in_child, first.device)
            if quiet and in_child:
                set_vars |= vllm_logs.quiet_child_environment()
            with _environment(set_vars, removed):
                self.llm = LLM(
                    model=config_dir,
                    load_format="dummy",
                    skip_tokenizer_init=True,
                    dtype=first.dtype,
                    enforce_eager=not cuda,
                    max_model_len=max_len,
                    seed=0,
                    generation_config="vllm",
                    logprobs_mode="processed_logprobs",
                    worker_extension_cls="distflow.rollout.vllm.worker.PolicyWeights",
                    **vllm_logs.engine_arguments(quiet),
                    **extra,
                )
        torch.set_num_threads = set_num_threads
        if isinstance(self.llm.llm_engine.engine_core, InprocClient) == in_child:
            raise RuntimeError(
                f"vLLM made its engine {'in this process' if in_child else 'in a child process'}, not as asked: "
                "vLLM reads VLLM_ENABLE_V1_MULTIPROCESSING once per process, at its first engine"
            )
        self._queues: EngineQueues | None = None
        engine_pid = self._own_child() if in_child else os.getpid()
        vllm_logs.started(
            in_child=in_child,
            engine_pid=engine_pid,
            architecture=(getattr(config, "architectures", None) or [type(inner).__name__])[0],
            dtype=str(first.dtype).removeprefix("torch."),
            max_len=max_len,
            memory="30% of the GPU's memory" if cuda else f"KV cache {os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB",
        )
        self.in_child = in_child
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self._shared: SharedWeights | None = None
        self.version: int | None = None
        """The version of the weights loaded (`push`); None: vLLM's dummy weights, before the first push."""
        self.num_pushes = 0

    def _own_child(self) -> int:
        """The child engine core's pid, once its queues are recorded (rollout/vllm/queues.py) and its worker
        watches this process (the engine core does not notice its parent's death)."""
        engine_pid = self.llm.llm_engine.engine_core.resources.engine_manager.processes[0].pid
        self._queues = EngineQueues(engine_pid)
        self.llm.collective_rpc("watch_owner", args=(os.getpid(),))
        return engine_pid

    def push(self, model: torch.nn.Module, version: int) -> None:
        """Load `model`'s weights, those of `version`, into the engine: in this process the tensors
        themselves, to a child a shared-memory file (rollout/vllm/worker.py)."""
        weights = list(hf_named_weights(model))
        if not self.in_child:
            self.llm.collective_rpc("load_policy_weights", args=(weights, self.tied))
        else:
            if self._shared is None:
                self._shared = SharedWeights(weights)
            self._shared.write(weights)
            try:
                self.llm.collective_rpc("load_shared_policy_weights", args=(self._shared.handle, self.tied))
            finally:
                self._shared.unlink()  # mapped on both sides by now: nothing is left behind, even after kill -9
        self.version = version
        self.num_pushes += 1

    def close(self) -> None:
        """End the engine through vLLM's own shutdown, given time to finish: a child engine's processes exit,
        unlinking their shared memory (vLLM's default grace, 5 s, was too short on a loaded 2-core machine:
        it killed them mid-teardown, leaving the memory behind). Then a child engine's queues that are left
        are unlinked: those of an engine that died by itself (rollout/vllm/queues.py)."""
        try:
            self.llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_GRACE_S)
        finally:
            if self._queues is not None:
                self._queues.remove()

    def generate(
        self,
        prompt_rows: list[list[int]],
        *,
        samples_per_prompt: int,
        keys: list[int] | None,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop_ids: tuple[int, ...],
        logprobs: bool,
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        """Token ids (and log-probs) of sample k of prompt g at row g·n + k; greedy without `keys`."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        n = samples_per_prompt
        prompts, params = [], []
        for g, row in enumerate(prompt_rows):
            for k in range(n):
                sampled = keys is not None
                params.append(
                    SamplingParams(
                        n=1,
                        max_tokens=max_new_tokens,
                        temperature=temperature if sampled else 0.0,
                        top_p=top_p if sampled else 1.0,
                        seed=request_seed(keys[g * n + k]) if sampled else None,
                        stop_token_ids=list(stop_ids),
                        ignore_eos=True,
                        detokenize=False,
                        logprobs=0 if logprobs else None,
                    )
                )
                prompts.append(TokensPrompt(prompt_token_ids=list(row)))
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        token_ids = [list(out.outputs[0].token_ids) for out in outputs]
        if not logprobs:
            return token_ids, None
        logps = [
            [step[tok].logprob for tok, step in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)]
            for out in outputs
        ]
        return token_ids, logps


_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def engine_for(model: torch.nn.Module, *, in_child: bool = False, log: bool = False) -> VllmEngine:
    """This rank's engine for `model` (made on first use, in this process or `in_child`, with vLLM's own log
    if `log`; see the module docstring), holding the weights of its last push (`VllmEngine.version`). A
    model has one engine: asking for the other mode is an error."""
    engine = _ENGINES.get(model)
    if engine is None:
        engine = _ENGINES[model] = VllmEngine(model, in_child=in_child, log=log)
    elif engine.in_child != in_child:
        where = "a child process" if engine.in_child else "this process"
        raise RuntimeError(f"this model's vLLM engine runs in {where}; it cannot be asked for the other mode")
    return engine


def close_engines() -> None:
    """End this process's engines now, at the end of the run. A child engine ended by the rank's exit, by
    signal, left vLLM's 160 MB message queue in /dev/shm. An engine in this process was shut down by
    vLLM's finalizer at interpreter exit, after the rank had destroyed its torch world, and printed a
    traceback ("Invalid process group specified") below a successful run's summary; shut down here, it
    tears down the process groups it built and then the rank's default group (vLLM's own teardown; the
    rank's `comm.shutdown` finds it gone)."""
    for model, engine in list(_ENGINES.items()):
        engine.close()
        del _ENGINES[model]


def vllm_responses(
    model: torch.nn.Module,
    prompt_ids_GP: torch.Tensor,
    prompt_mask_GP: torch.Tensor,
    keys_B: torch.Tensor | None,
    *,
    n: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop_ids: tuple[int, ...],
    pad_id: int,
    logprobs: bool,
    in_child: bool = False,
    log: bool = False,
    version: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`rollout.generation`'s contract for `vllm`: response ids [G·n, max_new_tokens] (right-padded) and,
    with `logprobs`, each sampled token's log-prob under the engine (temperature applied); `in_child`: the
    engine's core in a child process (`VllmRollout.in_child`); `log`: vLLM's own log shown (made
    with it; `rollout.vllm.log`); `version`: the version of the weights `model` holds (the last one
    announced, `VllmRollout.update_weights`), pushed first if the engine holds another."""
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids_GP.cpu(), prompt_mask_GP.cpu(), strict=True)]
    keys = keys_B.tolist() if keys_B is not None else None
    engine = engine_for(model, in_child=in_child, log=log)
    if engine.version != version:
        engine.push(model, version)
    token_ids, logps = engine.generate(
        rows,
        samples_per_prompt=n,
        keys=keys,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        stop_ids=stop_ids,
        logprobs=logprobs,
    )
    ids_BR, logp_BR = padded_responses(token_ids, logps, width=max_new_tokens, pad_id=pad_id)
    device = prompt_ids_GP.device
    return ids_BR.to(device), logp_BR.to(device) if logp_BR is not None else None
