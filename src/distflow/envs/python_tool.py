"""The sandboxed Python tool: run a snippet in a child process with hard limits.

    run_python(code) ──► child `python -I -S` in a fresh temp dir (its cwd, HOME, TMPDIR),
                         its own session; it sets its rlimits first (CPU seconds, address
                         space, file size, no core, no forks), then runs the code
                         no network: socket creation raises inside the child
                         wall-clock limit: killed (the whole process group) past it
                     ◄── (stdout+stderr truncated to max_output bytes, exit code, timed_out)

The child cannot write outside its temp dir: `open` for writing (and os.open with a write
flag, os.remove/rename/mkdir...) is refused for paths outside it by an audit hook installed
before the user's code runs. The temp dir is removed afterwards. This is containment against
mistakes of a model, not a security boundary against an adversary: use a container or a VM
for untrusted code at scale.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

# Runs in the child before the user's code (passed with -c; the code is read from a file).
_PRELUDE = r"""
import os, sys, socket, resource
for _limit, _value in ((resource.RLIMIT_CPU, {cpu_s}), (resource.RLIMIT_AS, {memory_bytes}),
                       (resource.RLIMIT_FSIZE, {file_bytes}), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(_limit, (_value, _value))  # hard = soft: the code cannot raise them again
if os.getuid() != 0:
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
_root = os.path.realpath(os.getcwd())
def _inside(path):
    try:
        p = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else _root)
    except Exception:
        return False
    return p == _root or p.startswith(_root + os.sep)
_WRITE = ("os.remove", "os.rename", "os.mkdir", "os.rmdir", "shutil.rmtree", "os.symlink", "os.link",
          "os.truncate", "os.chmod", "os.chown", "os.utime")
def _hook(event, args):
    if event == "open" and args and args[0] is not None:
        mode, flags = args[1], args[2]
        write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags & write_flags)
        if writing and not _inside(args[0]):
            raise PermissionError(f"sandbox: writing outside the working directory: {args[0]!r}")
    elif event in _WRITE and not all(_inside(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))):
        raise PermissionError(f"sandbox: {event} outside the working directory")
    elif event in ("socket.__new__", "socket.socket", "socket.connect", "socket.bind", "socket.getaddrinfo"):
        raise PermissionError("sandbox: no network")
    elif event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.fork"):
        raise PermissionError("sandbox: no processes")
sys.addaudithook(_hook)
del _hook
_code = open("main.py").read()
exec(compile(_code, "main.py", "exec"), {"__name__": "__main__"})
"""


@dataclass(frozen=True)
class PythonResult:
    output: str
    """stdout then stderr, truncated to `max_output` bytes (decoded leniently)."""
    returncode: int | None
    timed_out: bool
    truncated: bool


def run_python(
    code: str, *, cpu_s: int = 5, wall_s: float = 10.0, memory_mb: int = 512, max_output: int = 4096
) -> PythonResult:
    """Run `code` sandboxed; never raises for anything the code does."""
    with tempfile.TemporaryDirectory(prefix="distflow-py-") as workdir:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        out_path = os.path.join(workdir, ".out")
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "PYTHONIOENCODING": "utf-8"}
        with open(out_path, "wb") as out:
            prelude = _PRELUDE.replace("{cpu_s}", str(int(cpu_s))).replace("{memory_bytes}", str(memory_mb << 20))
            prelude = prelude.replace("{file_bytes}", str(max(max_output, 1 << 20)))
            # The limits are set by the child itself (first lines of the prelude), not in a
            # preexec_fn, which is unsafe when other threads run (the env calls' do).
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", prelude],
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # its own process group, killed whole on timeout
            timed_out = False
            try:
                proc.wait(timeout=wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with open(out_path, "rb") as out:
            data = out.read(max_output + 1)
    truncated = len(data) > max_output
    text = data[:max_output].decode("utf-8", errors="replace")
    return PythonResult(text, None if timed_out else proc.returncode, timed_out, truncated)
