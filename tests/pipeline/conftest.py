"""Fixtures of the pipeline tests: ONE real local SparkSession (local[2]) for the whole run.

The session starts with the first test that needs it and is stopped right after the last
pipeline test, so its JVM does not idle through the rest of the suite. (The standalone
network module runs a session of its own on a standalone master, after the others.)
"""

import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def java():
    """Spark's JVM (make test installs openjdk-17-jre-headless; a skip fails there)."""
    if shutil.which("java") is None:
        pytest.skip("Spark needs Java 17+")


@pytest.fixture
def spark(java):
    """The local[2] session, made by the first test that asks and kept for the next ones
    (made again when a module with a session of its own, a standalone cluster's, stopped it:
    a process holds one SparkContext)."""
    pytest.importorskip("pyspark", reason="the pipeline extra is not installed")
    from pyspark.sql import SparkSession

    from wrenmq.pipeline.spark import session

    s = SparkSession.getActiveSession()
    if s is None or s.sparkContext.master != "local[2]":
        if s is not None:
            s.stop()
        s = session("local[2]", app_name="wrenmq-tests", conf={"spark.sql.shuffle.partitions": "2"})
    return s


def _in_here(item):
    return HERE in Path(str(item.fspath)).resolve().parents


def pytest_runtest_teardown(item, nextitem):
    if nextitem is not None and _in_here(nextitem):
        return
    items = item.session.items
    try:
        rest = items[items.index(item) + 1:]
    except ValueError:
        return
    if any(_in_here(x) for x in rest) or "pyspark" not in sys.modules:
        return
    from pyspark.sql import SparkSession

    s = SparkSession.getActiveSession()
    if s is not None:
        s.stop()


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    return str(d)
