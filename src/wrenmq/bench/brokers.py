"""Start and stop the brokers under test (Mosquitto, wrenmq) as subprocesses."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

HOST = "127.0.0.1"
SBIN_PATH = "/usr/local/sbin:/usr/sbin:/sbin"


class BrokerError(RuntimeError):
    pass


class BrokerUnavailable(BrokerError):
    """The broker cannot be started at all (executable missing): do not retry."""


def which(cmd: str) -> str | None:
    """shutil.which that also looks in the sbin directories (mosquitto is in /usr/sbin)."""
    return shutil.which(cmd, path=os.environ.get("PATH", "") + os.pathsep + SBIN_PATH)


def port_open(port: int, host: str = HOST, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


try:
    _libc = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - not Linux/glibc
    _libc = None


def _child_setup() -> None:
    # Runs in the child between fork and exec: die with the harness even if it is
    # SIGKILLed (Linux PR_SET_PDEATHSIG; Mosquitto clears it when it drops root).
    if _libc is not None:
        _libc.prctl(1, signal.SIGKILL)


def tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


class Broker:
    """One broker under test. ``start()`` launches a fresh process and waits until its
    TCP port accepts connections; ``stop()`` sends SIGTERM, then SIGKILL."""

    name = "broker"
    ready_timeout = 15.0

    def __init__(self, port: int, log_dir: Path, cwd: Path):
        self.port = port
        self.log_dir = log_dir
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.log_path: Path | None = None
        self.tmp_dir: Path | None = None

    # subclasses fill these in
    def argv(self) -> list[str]:
        raise NotImplementedError

    def version(self) -> str:
        return "?"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.stop()
        if port_open(self.port):
            raise BrokerError(f"port {HOST}:{self.port} is already in use by another process; "
                              f"not starting {self.name}")
        self.starts += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"{self.name}-{self.starts}.log"
        argv = self.argv()
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(argv) + "\n").encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(
                    argv, cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=_child_setup,
                )
            except OSError as e:
                self.proc = None
                raise BrokerUnavailable(f"cannot start {self.name}: {e}") from e
        deadline = time.monotonic() + self.ready_timeout
        while True:
            rc = self.proc.poll()
            if rc is not None:
                self.stop()
                raise BrokerError(f"{self.name} exited with code {rc} while starting; "
                                  f"log {self.log_path}:\n{tail(self.log_path)}")
            if port_open(self.port, timeout=0.25):
                # still ours? (a process that dies right after binding would be caught here)
                if self.proc.poll() is None:
                    return
            if time.monotonic() > deadline:
                self.stop()
                raise BrokerError(f"{self.name} did not accept connections on {HOST}:{self.port} "
                                  f"within {self.ready_timeout:.0f} s; log {self.log_path}:\n{tail(self.log_path)}")
            time.sleep(0.05)

    def stop(self, grace: float = 5.0) -> int | None:
        """Stop the broker if running; returns its exit code (None if it was not running)."""
        p, self.proc = self.proc, None
        rc = None
        if p is not None:
            rc = p.poll()
            if rc is None:
                self._signal(p, signal.SIGTERM)
                try:
                    rc = p.wait(grace)
                except subprocess.TimeoutExpired:
                    self._signal(p, signal.SIGKILL)
                    rc = p.wait()
            # take out anything the broker left in its process group
            self._signal(p, signal.SIGKILL, group_only=True)
            deadline = time.monotonic() + 5
            while port_open(self.port, timeout=0.2) and time.monotonic() < deadline:
                time.sleep(0.05)
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.tmp_dir = None
        return rc

    @staticmethod
    def _signal(p: subprocess.Popen, sig: int, group_only: bool = False) -> None:
        try:
            os.killpg(p.pid, sig)  # start_new_session: pgid == pid
        except (ProcessLookupError, PermissionError):
            if not group_only:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass


class Mosquitto(Broker):
    name = "mosquitto"
    ready_timeout = 10.0

    def __init__(self, binary: str, conf: Path, log_dir: Path, cwd: Path):
        super().__init__(mosquitto_port(conf), log_dir, cwd)
        self.binary = binary
        self.conf = conf

    def argv(self) -> list[str]:
        return [self.binary, "-c", str(self.conf)]

    def version(self) -> str:
        try:
            out = subprocess.run([self.binary, "-h"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return "?"
        m = re.search(r"mosquitto version (\S+)", out)
        return m.group(1) if m else "?"


def mosquitto_port(conf: Path) -> int:
    """The port of the first `listener PORT [ADDR]` line of a Mosquitto config."""
    for line in conf.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "listener" and parts[1].isdigit():
            return int(parts[1])
    return 1883


class Wrenmq(Broker):
    name = "wrenmq"
    ready_timeout = 30.0

    def __init__(self, binary: str | None, port: int, log_dir: Path, cwd: Path,
                 config: str | None = None, extra_args: list[str] | None = None, data_dir: bool = True):
        super().__init__(port, log_dir, cwd)
        self.binary = binary
        self.config = config
        self.extra_args = extra_args or []
        self.use_data_dir = data_dir

    def argv(self) -> list[str]:
        if not self.binary or not os.access(self.binary, os.X_OK):
            raise BrokerUnavailable(f"wrenmq executable not found ({self.binary or 'wrenmq'}); "
                              "run `make bench` or `pip install -e .` first")
        argv = [self.binary, "serve", "--port", str(self.port), "--log-level", "warning"]
        if self.config:
            argv += ["--config", self.config]
        if self.use_data_dir:
            # a fresh, throw-away data directory per start (removed again by stop())
            base = self.log_dir.parent / "tmp"
            base.mkdir(parents=True, exist_ok=True)
            self.tmp_dir = Path(tempfile.mkdtemp(prefix="wrenmq-data-", dir=base))
            argv += ["--data-dir", str(self.tmp_dir)]
        return argv + self.extra_args

    def command_line(self) -> str:
        parts = ["wrenmq", "serve", "--port", str(self.port), "--log-level", "warning"]
        if self.config:
            parts += ["--config", self.config]
        if self.use_data_dir:
            parts += ["--data-dir", "<fresh tmp dir>"]
        return " ".join(parts + self.extra_args)

    def version(self) -> str:
        try:
            from .. import __version__
            return __version__
        except ImportError:  # pragma: no cover
            return "?"
