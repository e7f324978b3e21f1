"""Packaging: `python -m build` makes a wheel that installs in a fresh venv and serves MQTT to
mosquitto_pub/mosquitto_sub, with its compiled modules; a build without a C compiler gives
a wheel that runs the Python source; packaging/ has a unit that `systemd-analyze verify`
accepts and a default configuration that `wrenmq config check` accepts.

The wheels are built once per run (one module fixture, both builds at once), from a copy of the files git knows
(tracked and new, not ignored ones: no build/ left over, no .so from the editable install).
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, free_port, wait_port

pytestmark = pytest.mark.timeout(600)


def _source_copy(dest, with_generated_c=False):
    dest.mkdir(parents=True)
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / name.decode()
        if src.is_file():
            target = dest / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    if with_generated_c:
        # Cython's C from the editable install (make test-deps), newer than its .py: the
        # build skips cythonize and goes straight to the compiler, which here is `false`.
        for c in ("src/wrenmq/mqtt/codec.c", "src/wrenmq/store/_encode.c", "src/wrenmq/store/_epoch.c"):
            shutil.copy2(ROOT / c, dest / c)
    return dest


def _start_build(tmp, env=None, with_generated_c=False):
    src = _source_copy(tmp / "src", with_generated_c)
    out = tmp / "dist"
    proc = subprocess.Popen([sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(src)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    return proc, out


def _finish_build(proc, out):
    log, _ = proc.communicate(timeout=500)
    assert proc.returncode == 0, log[-5000:]
    wheels = list(out.glob("wrenmq-*.whl"))
    assert len(wheels) == 1
    return wheels[0]


class Installed:
    """One fresh venv, and which of the two wheels is installed in it."""

    def __init__(self, tmp, compiled, pure):
        self.venv = tmp / "venv"
        self.wheels = {"compiled": compiled, "pure": pure}
        self.current = None
        subprocess.run([sys.executable, "-m", "venv", str(self.venv)], check=True, timeout=120)

    def use(self, which):
        if self.current != which:
            # The first install brings the dependencies; a switch replaces wrenmq alone.
            extra = [] if self.current is None else ["--force-reinstall", "--no-deps"]
            r = subprocess.run([str(self.venv / "bin" / "pip"), "install", "-q", *extra,
                                str(self.wheels[which])], capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr[-3000:]
            self.current = which
        return self.venv, self.wheels[which]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Both wheels, built at once: with the compiler, and with CC=false (Cython's C from the
    editable install copied in, so that build goes straight to the failing compiler)."""
    tmp = tmp_path_factory.mktemp("wheels")
    compiled = _start_build(tmp / "compiled")
    pure = _start_build(tmp / "pure", env={"CC": "false"}, with_generated_c=True)
    return Installed(tmp, _finish_build(*compiled), _finish_build(*pure))


def _compiled_files(venv):
    code = ("import wrenmq.mqtt.codec as c, wrenmq.store._epoch as e, wrenmq.store.store as s;"
            "print(c.__file__); print(e.__file__); print(s._compiled_encode is not None)")
    r = subprocess.run([str(venv / "bin" / "python"), "-W", "error", "-c", code], capture_output=True,
                       text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def _serves_mqtt(venv, tmp):
    """`wrenmq serve` from the venv, a message from mosquitto_pub to mosquitto_sub."""
    port = free_port()
    cfg = tmp / "serve.toml"
    cfg.write_text('[storage]\nmode = "disk"\n')
    proc = subprocess.Popen([str(venv / "bin" / "wrenmq"), "serve", "--config", str(cfg), "--port", str(port),
                             "--data-dir", str(tmp / "data")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, cwd=tmp)
    try:
        wait_port(port, proc=proc)
        sub = subprocess.Popen(["mosquitto_sub", "-p", str(port), "-t", "pkg/test", "-C", "1", "-W", "10",
                                "-q", "1"], stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        subprocess.run(["mosquitto_pub", "-p", str(port), "-t", "pkg/test", "-m", "from the wheel", "-q", "1"],
                       check=True, timeout=10)
        out, _ = sub.communicate(timeout=15)
        assert out.strip() == "from the wheel"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    return err.decode()


def test_the_wheel_installs_with_its_compiled_modules_and_serves(installed, tmp_path):
    venv, wheel = installed.use("compiled")
    assert "linux" in wheel.name  # a platform wheel: the extensions are in it
    codec, epoch, encoder = _compiled_files(venv)
    # -W error: no "older than its source" warning either (the install's file times).
    assert codec.endswith(".so") and epoch.endswith(".so") and encoder == "True"
    log = _serves_mqtt(venv, tmp_path)
    assert "wrenmq" in log and "starting" in log


def test_without_a_compiler_the_wheel_runs_the_python_source(installed, tmp_path):
    venv, wheel = installed.use("pure")
    import zipfile
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.endswith((".so", ".c"))]
    codec, epoch, encoder = _compiled_files(venv)
    assert codec.endswith("codec.py") and epoch.endswith("_epoch.py") and encoder == "False"
    _serves_mqtt(venv, tmp_path)


def test_the_packaged_config_checks_and_the_unit_verifies(installed, tmp_path):
    venv, _ = installed.use(installed.current or "compiled")
    r = subprocess.run([str(venv / "bin" / "wrenmq"), "config", "check", str(ROOT / "packaging" / "wrenmq.toml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (make test-deps installs systemd)")
    # The unit names /opt/wrenmq, where the service's venv goes; verify checks that its
    # commands exist, so point it at the venv this test installed the wheel into.
    unit = tmp_path / "wrenmq.service"
    unit.write_text((ROOT / "packaging" / "wrenmq.service").read_text().replace("/opt/wrenmq", str(venv)))
    r = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    # verify exits 0 on unknown keys and bad values too, warning on stderr: none may be there.
    assert r.returncode == 0 and r.stderr.strip() == "" and r.stdout.strip() == "", r.stderr + r.stdout
    # And it does catch a mistake.
    bad = tmp_path / "bad" / "wrenmq.service"
    bad.parent.mkdir()
    bad.write_text(unit.read_text().replace("KillSignal=SIGTERM", "KillSignal=SIGTERN"))
    r = subprocess.run([analyze, "verify", str(bad)], capture_output=True, text=True, timeout=60)
    assert "SIGTERN" in r.stderr
