"""`python -m distflow ARGS` for the tests, in a process forked from one that has imported torch,
transformers and distflow already: a fresh interpreter spends ~4 s of a 2-core machine on those
imports, most of a tiny run and most of the default suite's time (~300 runs).

    test process (run_cli)        fork server (imports only)     monitor (a fork)      runner (a fork)
    ----------------------        --------------------------     ----------------      ---------------
    connect ── unix socket ─────▶ accept, fork ────────────────▶ read the request,
                                                                 fork ───────────────▶ chdir, environ, fds 1
    ◀─────────────────────────────────────────────── {"pid"} ──                       and 2 to files, then
                                                                 waitpid ◀────────────  `python -m distflow`
    ◀─────────────────────────────────────────────── {"status"}                       and interpreter exit

The runner is what `subprocess.run([python, "-m", "distflow", ...])` would start, less the start-up:
its own process, working directory, environment (PYTHONPATH too), argv, sys.path, stdout and stderr
(unbuffered), exit code (a signal: negative) and interpreter shutdown (non-daemon threads joined,
atexit handlers run). What differs: the modules imported here were imported before the test set
its environment, so a variable that a module reads only at import (none of distflow's) keeps the
server's value; and an import-time warning is printed by the server, not the run. Tests of the
start-up itself, of signals and of process trees start their own interpreters (test_startup,
test_faults, ...); DISTFLOW_TESTS_FRESH_INTERPRETERS=1 makes every run_cli do so too.

The server is never the test process: that one has run torch (OpenMP threads, locks) and forking
it would be unsafe. It is started on first use, one per pytest(-xdist) process, and ends with it.
"""

from __future__ import annotations

import atexit
import importlib
import io
import json
import os
import runpy
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

PRELOAD = (
    "numpy",
    "yaml",
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.elastic.multiprocessing",
    "torch.utils.tensorboard",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "matplotlib.pyplot",
    "tqdm",
    "distflow.cli",
    "distflow.runtime.executor",
    "distflow.runtime.launcher",
)
"""What a tiny run imports and spends its start-up on (`python -X importtime -m distflow train ...`)."""


class ForkServer:
    """The client side: one server process, one connection per run."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="distflow-forked-cli-")
        self.address = os.path.join(self.dir, "socket")
        self.process = subprocess.Popen(
            [sys.executable, __file__, self.address], stdin=subprocess.DEVNULL, env=dict(os.environ)
        )
        ready = Path(self.address + ".ready")
        while not ready.exists():  # the imports: seconds
            if self.process.poll() is not None:
                raise RuntimeError(f"the fork server for run_cli exited with {self.process.returncode} before serving")
            threading.Event().wait(0.05)
        atexit.register(self.close)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def run(self, args: list[str], *, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "distflow", *args]
        with tempfile.TemporaryDirectory(dir=self.dir) as out:
            paths = {name: os.path.join(out, name) for name in ("stdout", "stderr")}
            for path in paths.values():
                Path(path).touch()
            request = {"argv": list(args), "cwd": str(cwd), "env": env, **paths}
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(self.address)
                conn.sendall(json.dumps(request).encode() + b"\n")
                replies = _Replies(conn)
                pid = replies.next()["pid"]
                conn.settimeout(timeout)
                try:
                    status = replies.next()["status"]
                except TimeoutError:
                    os.kill(pid, signal.SIGKILL)
                    conn.settimeout(None)
                    replies.next()  # reaped by its monitor
                    raise subprocess.TimeoutExpired(cmd, timeout, *_read(paths)) from None
            stdout, stderr = _read(paths)
        return subprocess.CompletedProcess(cmd, os.waitstatus_to_exitcode(status), stdout, stderr)


class _Replies:
    """The monitor's JSON lines (a socket's file object cannot be read again after a timeout)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.buffer = conn, b""

    def next(self) -> dict:
        while b"\n" not in self.buffer:
            chunk = self.conn.recv(4096)
            if not chunk:
                raise RuntimeError("the fork server's monitor closed the connection without replying")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


def _read(paths: dict) -> tuple[str, str]:
    return tuple(Path(paths[name]).read_text(encoding="utf-8", errors="replace") for name in ("stdout", "stderr"))


_server: ForkServer | None = None


def server() -> ForkServer:
    """This process's fork server, started on first use (and again if it has ended)."""
    global _server
    if _server is None or _server.process.poll() is not None:
        _server = ForkServer()
    return _server


def run(args: list[str], *, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run([python, "-m", "distflow", *args], cwd=, env=, capture_output=True, text=True,
    timeout=)`, forked from this process's fork server."""
    return server().run(args, cwd=cwd, env=env, timeout=timeout)


# ---- the server side (this file run as a script) ----


def _serve(address: str) -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    # A Python thread would be gone in a fork and could leave its locks held there. (numpy's OpenBLAS
    # starts its pool at import; it re-creates the pool in a forked child, as under multiprocessing.)
    if threading.active_count() != 1:
        raise RuntimeError(f"the fork server runs Python threads after its imports: {threading.enumerate()}")
    # A fresh `python -m` puts the working directory first, then PYTHONPATH's entries, then the rest.
    own = _pythonpath()
    base = sys.path[1 + len(own) :]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    Path(address + ".ready").touch()
    parent = os.getppid()
    listener.settimeout(5.0)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the test process is gone (killed: its atexit never ran)
                return
            continue
        conn.settimeout(None)
        while True:  # reap the monitors that have ended
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if os.fork() == 0:
            listener.close()
            try:
                _monitor(conn, own, base)
            finally:
                os._exit(0)
        conn.close()


def _monitor(conn: socket.socket, own: list[str], base: list[str]) -> None:
    request = json.loads(conn.makefile("r", encoding="utf-8").readline())
    pid = os.fork()
    if pid == 0:
        conn.close()
        _runner(request, own, base)  # never returns
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    _, status = os.waitpid(pid, 0)
    conn.sendall(json.dumps({"status": status}).encode() + b"\n")


def _runner(request: dict, own: list[str], base: list[str]) -> None:
    """`own`: the server's PYTHONPATH entries; `base`: its sys.path after them."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, name in ((1, "stdout"), (2, "stderr")):
            target = os.open(request[name], os.O_WRONLY | os.O_APPEND)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout = sys.__stdout__ = _text(1, "strict")
        sys.stderr = sys.__stderr__ = _text(2, "backslashreplace")
        extra = _pythonpath()
        sys.path[:] = [request["cwd"], *extra, *base]
        importlib.invalidate_caches()
        if extra != own:  # the start-up's hook where the run's PYTHONPATH has one (a test's fault injection)
            sys.modules.pop("sitecustomize", None)
            site.execsitecustomize()
        sys.argv = ["-m", *request["argv"]]
        code = _main()
        threading._shutdown()  # what interpreter shutdown does, in its order: join threads, then atexit
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        os._exit(code)


def _pythonpath() -> list[str]:
    """This process's PYTHONPATH entries, as the interpreter adds them to sys.path at start-up."""
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def _text(fd: int, errors: str) -> io.TextIOWrapper:
    """The stream a fresh interpreter makes for `fd` under PYTHONUNBUFFERED (every write reaches the file)."""
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors=errors, write_through=True)


def _main() -> int:
    """`python -m distflow`'s exit code, as the interpreter derives it."""
    try:
        runpy.run_module("distflow", run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        if exit_.code is None:
            return 0
        if isinstance(exit_.code, int):
            return exit_.code & 0xFF
        print(exit_.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the interpreter ends by SIGINT then: exit code -2
        sys.excepthook(*sys.exc_info())
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


if __name__ == "__main__":
    _serve(sys.argv[1])
