"""Checks of the files and directories a run will use, made before any rank starts.

A rank that meets a bad input mid-run fails with a traceback, after minutes of work, on
every rank at once; the CLI meets it here first and prints one line naming the setting
and the fix. What is checked:

    directories   trainer.output_dir (and the run directory), checkpoint.dir,
                  warmstart.cache_dir: each is, or can be created as, a writable directory
    data files    task.train_file / task.heldout_file: readable files of a supported kind, with
                  rows; task.dataset's files: readable, with rows
    model         model.path: a readable config.json (routers where model.moe.aux_loss_coef > 0),
                  weight files that are complete (safetensors headers against file sizes), and a
                  tokenizer whose ids all fit in the model's embeddings; task.reward_models[].path: a one-label
                  sequence classifier with complete weight files
    parts         what each part of the run needs (its `preflight`: for vllm, that vLLM imports), and the
                  trained models' rules (config/parts.py)
    strategy      parallel.param_dtype / reduce_dtype that the device can use; decoder blocks
                  to checkpoint (parallel.activation_checkpointing, built on the meta device);
                  model.lora's adapters (built on the meta device), their rank within the
                  adapted layers' dimensions
    resume        a pipelined checkpoint's batches in flight: the same max_staleness and world size

Only the headers of weight files are read: this costs milliseconds, not a model load.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from distflow.config.parallel import ParallelConfig
from distflow.config.schema import Config, ConfigError
from distflow.preflight.parts import check_parts, run_parts  # noqa: F401 (preflight.check_parts, as the others)
from distflow.tasks.model_source import is_converted

SAFETENSORS_HEADER_LIMIT = 100 * 2**20
"""safetensors refuses headers larger than this; a larger length means a damaged file."""


def check_directories(config: Config, run_dir: Path) -> None:
    """Every directory the run writes into exists as a directory or can be created."""
    check_writable_dir(Path(config.trainer.output_dir), "trainer.output_dir")
    check_writable_dir(run_dir, "the run directory (trainer.output_dir/trainer.run_name)")
    if config.checkpoint.dir:
        check_writable_dir(Path(config.checkpoint.dir), "checkpoint.dir")
    if config.model.path is None:
        check_writable_dir(Path(config.warmstart.cache_dir), "warmstart.cache_dir")


def check_writable_dir(path: Path, key: str) -> None:
    path = path.expanduser()
    existing = path
    while not existing.exists() and not existing.is_symlink() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing.is_file() else "is not a directory"
        where = f"{str(path)!r} {what}" if existing == path else f"{str(existing)!r}, a parent of {str(path)!r}, {what}"
        raise ConfigError(f"{key}: {where}; point it at a directory (or a path that can become one)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: cannot write into {str(existing)!r} (permission denied); choose a writable place")


def check_data_files(config: Config) -> None:
    """Every dataset file is of a supported kind, is readable and has rows (that each of
    task.train_file and task.heldout_file is a file, `build_graph` checked before)."""
    from distflow.data.sources import JSONL_SUFFIXES, PARQUET_SUFFIXES

    for key in ("train_file", "heldout_file"):
        value = getattr(config.task, key)
        if value is None:
            continue
        path = Path(value).expanduser()
        if path.suffix.lower() not in PARQUET_SUFFIXES + JSONL_SUFFIXES:
            raise ConfigError(
                f"task.{key}={value!r}: unsupported dataset file, the extension must be one of "
                f"{', '.join(PARQUET_SUFFIXES + JSONL_SUFFIXES)}"
            )
        _check_readable(path, f"task.{key}")
        _check_has_rows(path, f"task.{key}", value)
    dataset = config.task.dataset
    if dataset is not None:
        for key, value in (("path", dataset.path), ("heldout_path", dataset.heldout_path)):
            if value is not None and not Path(value).expanduser().exists():
                raise ConfigError(
                    f"task.dataset.{key}={value!r} does not exist; point it at a directory saved "
                    "with datasets' save_to_disk or a .parquet/.jsonl/.json/.csv file"
                )
            if value is not None and Path(value).expanduser().is_file():
                _check_readable(Path(value).expanduser(), f"task.dataset.{key}")
                _check_has_rows(Path(value).expanduser(), f"task.dataset.{key}", value)


def _check_has_rows(path: Path, key: str, value: str) -> None:
    from distflow.data.sources import is_empty_file

    if is_empty_file(path):
        raise ConfigError(f"{key}={value!r} has no rows (the file is empty); give a file with at least one row")


def _check_readable(path: Path, key: str) -> None:
    try:
        with path.open("rb") as f:
            f.read(1)
    except OSError as err:
        raise ConfigError(f"{key}: cannot read {str(path)!r}: {err.strerror or err}") from None


def check_model_dir(config: Config) -> None:
    """A local model directory that loads: config, complete weights, tokenizer within the vocabulary."""
    tokenizer_path = config.model.tokenizer_path
    if tokenizer_path is not None and not Path(tokenizer_path).expanduser().is_dir():
        raise ConfigError(f"model.tokenizer_path={tokenizer_path!r} is not a directory")
    if config.model.path is None:
        return
    from distflow.tasks.model_source import is_converted, resolve_model_dir, source_file

    model_dir = resolve_model_dir(config.model.path, builder=False)
    if (
        is_converted(config.model.path)
        and source_file(config.model.path).is_file()
        and not (model_dir / "config.json").is_file()
    ):
        return  # a GGUF file not converted yet: `distflow train` converts it before any rank starts
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model.path={config.model.path!r} is not a Hugging Face model directory (no config.json)")
    _check_readable(model_dir / "config.json", "model.path")
    try:
        model_config = json.loads((model_dir / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"model.path: {str(model_dir / 'config.json')!r} is not valid JSON ({err})") from None
    if not isinstance(model_config, dict):
        raise ConfigError(f"model.path: {str(model_dir / 'config.json')!r} must hold a JSON object")
    config.model.moe.check_model(model_config)  # a load-balancing loss needs routers
    _check_weights(model_dir, "model.path", config.model.path)
    _check_vocabulary(model_config, model_dir, Path(tokenizer_path or model_dir).expanduser())


def _check_weights(model_dir: Path, key: str, value: str) -> None:
    """A model directory (the policy's, a reward model's) holds complete weight files."""
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights and not any(model_dir.glob("pytorch_model*.bin")):
        raise ConfigError(
            f"{key}={value!r} has no weights (*.safetensors or pytorch_model*.bin); "
            "copy the model's weight files into it, or save it with save_pretrained"
        )
    for path in weights:
        _check_safetensors(path, key)


def _check_safetensors(path: Path, key: str) -> None:
    """The header is intact and the file holds every byte it announces (a copy cut short does not)."""
    _check_readable(path, key)
    size = path.stat().st_size
    problem = None
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if size < 8 or length > min(size - 8, SAFETENSORS_HEADER_LIMIT):
            problem = f"its header is cut short ({size} bytes in all)"
        else:
            try:
                header = json.loads(f.read(length))
                end = max(
                    (entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"), default=0
                )
            except (ValueError, TypeError, KeyError, IndexError, AttributeError):
                header, problem = None, "its header is not valid safetensors JSON"
            if header is not None and 8 + length + end > size:
                problem = f"it is truncated: {size} bytes, its header describes {8 + length + end}"
    if problem:
        raise ConfigError(f"{key}: weight file {str(path)!r} is damaged: {problem}; copy or download it again")


def _check_vocabulary(model_config: dict, model_dir: Path, tokenizer_dir: Path) -> None:
    """Every token id the tokenizer can produce must index the model's embedding matrix."""
    vocab_size = model_config.get("vocab_size") or (model_config.get("text_config") or {}).get("vocab_size")
    if not isinstance(vocab_size, int):
        return  # the model's own loader decides
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except Exception as err:  # noqa: BLE001 — any failure to load a user's tokenizer is a user error
        raise ConfigError(
            f"cannot load the tokenizer from {str(tokenizer_dir)!r}: {type(err).__name__}: {err}".replace("\n", " ")
        ) from None
    num_ids = max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)
    if num_ids > vocab_size:
        raise ConfigError(
            f"the tokenizer in {str(tokenizer_dir)!r} has {num_ids} token ids but the model in "
            f"{str(model_dir)!r} has embeddings for {vocab_size} (vocab_size in its config.json); "
            "use the tokenizer the model was trained with, or resize the model's embeddings"
        )


def check_reward_models(config: Config) -> None:
    """Each `task.reward_models[].path` is a saved one-label sequence classifier (read from its config.json)."""
    for i, spec in enumerate(config.task.reward_models):
        key, directory = f"task.reward_models[{i}].path", Path(spec.path).expanduser()
        if not (directory / "config.json").is_file():
            raise ConfigError(
                f"{key}: {spec.path!r} is not a Hugging Face model directory (no config.json); "
                "give the directory of a saved AutoModelForSequenceClassification"
            )
        model_config = json.loads((directory / "config.json").read_text())
        architectures = model_config.get("architectures") or []
        if not any(name.endswith("ForSequenceClassification") for name in architectures):
            raise ConfigError(
                f"{key}: {spec.path!r} holds {architectures or 'an unnamed architecture'}, not a "
                "sequence classifier; save a reward model from "
                "AutoModelForSequenceClassification(..., num_labels=1)"
            )
        labels = len(model_config.get("id2label") or {"0": "", "1": ""})  # transformers' default is 2
        if labels != 1:
            raise ConfigError(f"{key}: {spec.path!r} has {labels} labels; a reward model has one (its score)")
        _check_weights(directory, key, spec.path)


def check_lora(config: Config) -> None:
    """`model.lora` fits the model: its adapters built on the meta device (no weights, no memory),
    with peft's own choice of layers, and their rank checked against those layers' dimensions."""
    if not config.model.lora.enabled:
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from distflow.training.lora import apply_lora

    if config.model.path is None:
        from distflow.tasks.tiny_model import build_tiny_model
        from distflow.tasks.tokenizer import build_char_tokenizer

        with torch.device("meta"):
            model = build_tiny_model(build_char_tokenizer(), seed=0)
    else:
        from distflow.tasks.model_source import resolve_model_dir

        model_dir = resolve_model_dir(config.model.path, builder=False)
        if not (model_dir / "config.json").is_file():
            return  # a GGUF file not converted yet: checked by the ranks when they apply the adapters
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    with warnings.catch_warnings():  # transformers' deprecation notes, which every rank prints again anyway
        warnings.simplefilter("ignore")
        apply_lora(model, config.model.lora, seed=0)  # a ConfigError naming model.lora if they do not fit


def check_cache_layout(config: Config) -> None:
    """`rollout.compact.slots` keep one cache layout for every layer: a model directory whose config makes
    sliding-window layers (rollout/graphed.py's test, on its config alone) is refused here."""
    from distflow.config.components import ROLLOUT_ENGINES

    _, settings = ROLLOUT_ENGINES.chosen(config.rollout, "engine")
    if getattr(settings, "slots", 0) == 0 or config.model.path is None:
        return
    from transformers import AutoConfig

    from distflow.rollout.graphed import config_has_sliding_layers
    from distflow.rollout.slots import SLIDING_REFUSAL
    from distflow.tasks.model_source import resolve_model_dir

    model_dir = resolve_model_dir(config.model.path, builder=False)
    if not (model_dir / "config.json").is_file():
        return  # a GGUF file not converted yet: the first rollout checks its cache
    if config_has_sliding_layers(AutoConfig.from_pretrained(model_dir)):
        raise ConfigError(SLIDING_REFUSAL)


def check_loggers(config: Config) -> None:
    """A logger whose package is missing fails here, before any rank starts."""
    import importlib.util

    if "wandb" in config.trainer.loggers and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "trainer.loggers includes wandb, but the wandb package is not installed: "
            "pip install 'distflow[wandb]' (or remove wandb from trainer.loggers)"
        )


def check_chat_template(config: Config) -> None:
    """`model.chat_template`: one of distflow's templates, or a readable file."""
    from distflow.training.chat_templates import CHAT_TEMPLATES

    choice = config.model.chat_template
    if choice is None or choice in CHAT_TEMPLATES:
        return
    path = Path(choice).expanduser()
    if not path.is_file() or not os.access(path, os.R_OK):
        raise ConfigError(
            f"model.chat_template={choice!r} is neither one of distflow's ({', '.join(CHAT_TEMPLATES)}) nor a "
            "readable Jinja file: name one, or give the file's path"
        )


def check_strategy(config: Config) -> None:
    """Precision the device supports, and decoder blocks where activation checkpointing needs them."""
    parallel = config.parallel
    if parallel.strategy == "fsdp2" and {parallel.param_dtype, parallel.reduce_dtype} - {"auto", "float32"}:
        _check_precision(parallel)
    if parallel.activation_checkpointing and config.model.path is not None:
        from distflow.tasks.model_source import resolve_model_dir

        model_dir = resolve_model_dir(config.model.path, builder=False)
        if (model_dir / "config.json").is_file() or not is_converted(config.model.path):
            _check_decoder_blocks(model_dir)  # (a GGUF file not converted yet is checked by its first run)


def _check_precision(parallel: ParallelConfig) -> None:
    import torch

    cuda = parallel.device == "cuda" or (parallel.device == "auto" and torch.cuda.is_available())
    for key in ("param_dtype", "reduce_dtype"):
        value = getattr(parallel, key)
        # torch 2.13 runs float16 FSDP2 on CPU, but CPU has no loss scaling and bfloat16 has float32's range.
        if value == "float16" and not cuda:
            raise ConfigError(
                f"parallel.{key}=float16 is not supported on the CPU (no loss scaling there); use bfloat16 or float32"
            )
        if value == "bfloat16" and cuda and not torch.cuda.is_bf16_supported():
            raise ConfigError(f"parallel.{key}=bfloat16: this CUDA device has no bfloat16; use float16 or float32")


def _check_decoder_blocks(model_dir: Path) -> None:
    """Build the model's modules on the meta device (no weights, no memory) and look for its blocks."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from distflow.training.parallelize import decoder_blocks

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    decoder_blocks(model)  # a ConfigError naming parallel.activation_checkpointing if there are none


def inflight_steps(saved: dict) -> list[int]:
    """The steps whose batches a checkpoint's pipeline state (runtime/pipelined.py) holds: drawn,
    not yet trained. Checkpoints written before the state named them: rank 0's transfer records'."""
    if "inflight_steps" in saved:
        return [int(step) for step in saved["inflight_steps"]]
    return sorted(int(step) for step in (saved["moved"][0] if saved.get("moved") else {}))


def check_resume_inflight(checkpoint: Path, extra: dict, config: Config, world_size: int) -> None:
    """A checkpoint of a pipelined run with batches in flight continues only as that run: the
    same asynchronous.max_staleness and world size (the train ranks are checked when the ranks have
    their plan). With nothing in flight (a finished run's last checkpoint) any will do."""
    saved = extra.get("pipeline")
    if not saved or not inflight_steps(saved):
        return
    k, world = saved["max_staleness"], saved["world_size"]
    if (k, world) != (config.asynchronous.max_staleness, world_size):
        raise ConfigError(
            f"checkpoint {checkpoint} holds the batches in flight of a run with asynchronous.max_staleness="
            f"{k} on {world} ranks (steps {', '.join(map(str, inflight_steps(saved)))} drawn ahead): "
            f"resume it with the same max_staleness and world size (asynchronous.max_staleness={k}, "
            f"{world} ranks), or from the run's last checkpoint once it has finished"
        )


def check_resume_partial(checkpoint: Path, extra: dict, config: Config, world_size: int) -> None:
    """A checkpoint of a run with partial rollouts whose samples are in flight (dag/partial_stage.py keeps
    them on the rank that started them) continues only on as many ranks, with rollout.partial on."""
    saved = (extra.get("parts") or {}).get("rollout") or {}
    in_flight, world = int(saved.get("samples_in_flight", 0)), saved.get("world_size")
    held = f"{in_flight} samples" if in_flight else None
    pipeline = extra.get("pipeline") or {}
    if pipeline.get("stage_states_of"):  # an asynchronous run's rollout ranks carried samples (train ranks saved)
        held, world = held or "the samples", pipeline["world_size"]
    if held is None:
        return
    if world != world_size or not config.rollout.partial:
        raise ConfigError(
            f"checkpoint {checkpoint} holds {held} in flight of a run with rollout.partial on "
            f"{world} ranks, each kept by the rank that started it: resume it on {world} ranks with "
            "rollout.partial > 0"
        )
