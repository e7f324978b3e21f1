"""The modules the install compiles (wrenmq._compiled): built, and their source still right.

The full suite runs the compiled codec; here the codec's tables also run against the
Python source (WRENMQ_PURE_PYTHON=1), and an extension older than its source is not
used, so an edited module is never shadowed by a stale build.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import wrenmq
import wrenmq.mqtt.codec as codec
import wrenmq.store._encode as encode
import wrenmq.store._epoch as epoch
from wrenmq._compiled import COMPILED_MODULES, compiled

ROOT = Path(__file__).resolve().parent.parent
PKG = Path(wrenmq.__file__).parent


def test_the_install_compiled_them():
    # make test installs a C compiler first; without one the install falls back to
    # the Python source, and this says so.
    assert compiled(codec), f"mqtt/codec.py was not compiled by the install: {codec.__file__}"
    assert compiled(encode) and encode.COMPILED
    assert compiled(epoch), f"store/_epoch.py was not compiled by the install: {epoch.__file__}"
    assert set(COMPILED_MODULES) == {"wrenmq.mqtt.codec", "wrenmq.store._encode", "wrenmq.store._epoch"}


def test_codec_tables_pass_on_the_python_source():
    env = dict(os.environ, WRENMQ_PURE_PYTHON="1")
    check = subprocess.run([sys.executable, "-c", "import wrenmq.mqtt.codec as c; print(c.__file__)"],
                           env=env, capture_output=True, text=True, timeout=60)
    assert check.stdout.strip().endswith("codec.py"), check
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(ROOT / "tests" / "test_codec.py")],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


def test_an_extension_older_than_its_source_is_not_used(tmp_path):
    copy = tmp_path / "wrenmq"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__"))
    probe = "import wrenmq.mqtt.codec as c; print(c.__file__)"
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop("WRENMQ_PURE_PYTHON", None)
    fresh = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert fresh.stdout.strip().endswith(".so"), fresh  # copied together: same age
    source = copy / "mqtt" / "codec.py"
    later = max(p.stat().st_mtime for p in (copy / "mqtt").iterdir()) + 10
    os.utime(source, (later, later))
    stale = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert stale.stdout.strip() == str(source), stale
    assert "older than" in stale.stderr and "codec.py" in stale.stderr
