"""`distflow export` when the disk fills: one line naming the output directory and its free space, exit 2,
and nothing half-written left, as for the model caches (tests/test_model_conversion_faults.py)."""

import errno
import os
import subprocess
import sys

import pytest
from test_checkpoint import SINGLE, make_engine, save, train_step

from distflow.checkpoint.contents import read_meta

# sitecustomize runs in every Python process started with its directory on PYTHONPATH: safetensors' writer
# fills the disk, half the file then the SafetensorError a full disk gives (measured on a 64 KiB tmpfs).
FULL_DISK_HOOK = """
from safetensors import SafetensorError, torch as safetensors_torch


def serialize_file(tensors, filename, metadata=None):
    with open(filename, "wb") as f:
        f.write(b"x" * 1000)
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


safetensors_torch.serialize_file = serialize_file
"""


@pytest.mark.parametrize("out_exists", [False, True])
def test_a_full_disk_is_one_line_naming_the_output_directory_and_its_free_space(tmp_path, out_exists):
    """The real command in a fresh interpreter (the hook must run before distflow's imports)."""
    engine = make_engine(SINGLE, seed=0)
    train_step(engine, 0)
    checkpoint = save(tmp_path / "ckpt", 1, engine)
    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks/sitecustomize.py").write_text(FULL_DISK_HOOK)
    out = tmp_path / "hf"
    if out_exists:  # an empty --out is accepted: it stays, empty
        out.mkdir()
    paths = (str(tmp_path / "hooks"), os.environ.get("PYTHONPATH", ""))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(p for p in paths if p))
    done = subprocess.run(
        [sys.executable, "-m", "distflow", "export", str(checkpoint), "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "SafetensorError" not in done.stderr, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("distflow: error: "), line
    assert f"writing the exported model into {str(out)!r} failed: No space left on device (" in line, line
    assert " GiB free there)" in line and "--out" in line, line
    assert list(out.iterdir()) == [] if out_exists else not out.exists()  # the half-written output is removed
    read_meta(checkpoint)  # the checkpoint itself is untouched


def test_a_checkpoint_that_cannot_be_read_is_not_called_a_full_disk(tmp_path, monkeypatch):
    """Only a write the filesystem refused is the one line: a read of the checkpoint that fails stays its own
    error."""
    from distflow.checkpoint import export as export_module
    from distflow.checkpoint import export_hf

    engine = make_engine(SINGLE, seed=0)
    checkpoint = save(tmp_path / "ckpt", 1, engine)
    shard = str(checkpoint / "__0_0.distcp")

    def unreadable(*args, **kwargs):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", shard)

    monkeypatch.setattr(export_module.dcp, "load", unreadable)
    with pytest.raises(FileNotFoundError):
        export_hf(checkpoint, tmp_path / "hf")
