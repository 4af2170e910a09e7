"""Run untrusted programs (Python) in a sandbox: own user, PID, network and mount namespaces, a
dropped uid when started as root, rlimits, a wall-clock timeout that kills the whole process group,
an empty working directory, no inherited environment, capped output.

    result = run(source, stdin="", timeout_s=2.0, memory_mb=256)
    result.stdout, result.stderr, result.exit_code, result.timed_out, result.error

Inside: the program runs as root of a fresh user namespace mapped to an unprivileged uid of its own
outside (when the caller is root; otherwise to the caller), as PID 1's child of a new PID namespace (nothing outside is
visible, and everything inside dies with it), without network (a new network namespace has only a
down loopback), with /tmp, /var/tmp and /dev/shm replaced by read-only empty filesystems, and with
RLIMIT_NPROC (effective because the uid is not root), RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE and
RLIMIT_NOFILE set.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Optional


# Each run gets its own unprivileged uid (when started as root), so that RLIMIT_NPROC, which counts
# a uid's processes system-wide, is a per-sandbox budget and concurrent runs cannot starve each other.
UID_BASE, UID_RANGE = 200_000, 100_000
OUTPUT_CAP = 1 << 20  # bytes kept per stream; more output stops the program
# The program file is opened before /tmp is hidden (the working directory lives there); the
# process keeps its working directory by reference, so relative writes still land in it.
# setsid: the program gets its own session and process group, so kill(0) or killpg from inside
# cannot reach unshare outside the PID namespace (which would orphan the namespace's init).
_SETUP = ("exec 3<main.py || exit 126; for d in /tmp /var/tmp /dev/shm; do [ -d $d ] && "
          "mount -t tmpfs -o ro none $d; done; exec setsid \"$@\" /dev/fd/3")


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: Optional[int]
    timed_out: bool
    error: Optional[str]  # None when the program ran to exit code 0 within every limit

    @property
    def ok(self) -> bool:
        return self.error is None


def _interpreter() -> str:
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError("no system python3 that an unprivileged sandbox user can execute")


def _sandbox_uid(work: str) -> int:
    return UID_BASE + int.from_bytes(os.path.basename(work).encode()[-8:], "little") % UID_RANGE


def _limits(timeout_s: float, memory_mb: int, uid: Optional[int]):
    def apply():
        os.setsid()  # its own process group: the timeout kills the group
        cpu = max(1, int(timeout_s) + 1)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        mem = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if uid is not None:  # RLIMIT_NPROC does not bind root
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
    return apply


def _drain(stream, sink: bytearray, over: threading.Event) -> None:
    while True:
        chunk = stream.read(65536)
        if not chunk:
            return
        room = OUTPUT_CAP - len(sink)
        if room > 0:
            sink.extend(chunk[:room])
        if len(chunk) > room:
            over.set()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_namespace(proc: subprocess.Popen) -> None:
    """Kill the namespace's init (unshare's child): the kernel then kills everything in the PID
    namespace, and unshare, still alive, reaps its child, so no zombie is left to the host's init.
    Falls back to killing the whole process group."""
    try:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        children = []
    for child in children:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        _kill_group(proc)


def run(source: str, stdin: str = "", *, timeout_s: float = 2.0, memory_mb: int = 256
        ) -> SandboxResult:
    """Run Python ``source`` with ``stdin`` in the sandbox; never raises for what the program does."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return SandboxResult("", "", None, False, "sandbox unavailable: unshare not found")
    work = tempfile.mkdtemp(prefix="sandbox-")
    uid = _sandbox_uid(work) if os.geteuid() == 0 else None
    try:
        with open(os.path.join(work, "main.py"), "w") as f:
            f.write(source)
        if uid is not None:
            os.chown(work, uid, uid)
            os.chown(os.path.join(work, "main.py"), uid, uid)
        cmd = [unshare, "--user", "--map-root-user", "--mount", "--pid", "--net", "--ipc", "--uts",
               "--fork", "--kill-child", "sh", "-c", _SETUP, "sandbox", _interpreter(), "-I", "-S"]
        try:
            proc = subprocess.Popen(cmd, cwd=work, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                                    preexec_fn=_limits(timeout_s, memory_mb, uid), close_fds=True)
        except OSError as e:
            return SandboxResult("", "", None, False, f"sandbox unavailable: {e}")
        out, err, over = bytearray(), bytearray(), threading.Event()
        readers = [threading.Thread(target=_drain, args=(proc.stdout, out, over), daemon=True),
                   threading.Thread(target=_drain, args=(proc.stderr, err, over), daemon=True)]
        for t in readers:
            t.start()
        try:
            proc.stdin.write(stdin.encode())
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        deadline = time.monotonic() + timeout_s
        timed_out = False
        while proc.poll() is None:
            if over.is_set():
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.01)
        if proc.poll() is None:
            _kill_namespace(proc)
        code = proc.wait()
        for t in readers:
            t.join(timeout=2)
        error = None
        if timed_out:
            error = f"timeout after {timeout_s:g} s"
        elif over.is_set():
            error = f"output over {OUTPUT_CAP} bytes"
        elif code < 0:
            error = f"killed by signal {signal.Signals(-code).name}"
        elif code == 137 or code == 128 + signal.SIGXCPU:
            error = f"killed (exit code {code})"
        elif code != 0:
            last = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
            error = f"exit code {code}: {last[0][:200]}"
        return SandboxResult(out.decode(errors="replace"), err.decode(errors="replace"),
                             None if timed_out else code, timed_out, error)
    finally:
        shutil.rmtree(work, ignore_errors=True)
