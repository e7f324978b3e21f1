"""Fixtures of the pipeline tests: ONE real local SparkSession (local[2]) for the whole run."""

import shutil

import pytest


@pytest.fixture(scope="session")
def spark():
    pytest.importorskip("pyspark", reason="the pipeline extra is not installed")
    if shutil.which("java") is None:  # make test installs openjdk-17-jre-headless
        pytest.skip("Spark needs Java 17+")
    from wrenmq.pipeline.spark import session

    s = session("local[2]", app_name="wrenmq-tests", conf={"spark.sql.shuffle.partitions": "2"})
    yield s
    s.stop()


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    return str(d)
