"""A SparkSession set up for wrenmq: loopback only, no UI, small local defaults, quiet.

    from wrenmq.pipeline.spark import session
    spark = session()                    # local[*]; session("spark://host:7077") for a cluster

Local masters bind the driver to 127.0.0.1 (`SPARK_LOCAL_IP`, `spark.driver.host`,
`spark.driver.bindAddress`) and leave the UI off unless asked (`ui=True` or
`conf={"spark.ui.enabled": "true"}`); `spark.sql.shuffle.partitions` is sized to the cores
(a stateful query freezes it into its checkpoint on first run); the Python workers run the
interpreter that runs this code (`PYSPARK_PYTHON`), so they can import `wrenmq`; and the JVM
logs warnings only. The `wrenmq` data source is registered on the session.
"""

import os
import sys
from importlib import resources

MIN_JAVA = 17


def _is_local(master):
    return master is None or master == "local" or master.startswith("local[") or master.startswith("local-")


def _local_cores(master):
    if master and master.startswith("local["):
        n = master[6:].split(",")[0].rstrip("]")
        if n.isdigit():
            return int(n)
    return os.cpu_count() or 2


def check_java():
    """Raise RuntimeError unless a Java 17+ runtime is on PATH (or JAVA_HOME)."""
    import re
    import shutil
    import subprocess

    java = os.path.join(os.environ["JAVA_HOME"], "bin", "java") if os.environ.get("JAVA_HOME") else None
    java = java if java and os.path.exists(java) else shutil.which("java")
    if not java:
        raise RuntimeError("Spark needs Java 17 or newer: install it (Debian: apt-get install "
                           "openjdk-17-jre-headless) or set JAVA_HOME")
    out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if m:
        major = int(m.group(1))
        if major == 1 and m.group(2):
            major = int(m.group(2))
        if major < MIN_JAVA:
            raise RuntimeError(f"Spark needs Java {MIN_JAVA} or newer; {java} is Java {major}")
    return java


def log4j_config():
    return str(resources.files("wrenmq.pipeline").joinpath("log4j2.properties"))


def session(master=None, app_name="wrenmq-pipeline", conf=None, ui=False, shuffle_partitions=None):
    """Get or create the SparkSession (see the module docstring)."""
    check_java()
    local = _is_local(master)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if local:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    from .source import WrenDataSource

    master = master or "local[*]"
    cores = _local_cores(master) if local else None
    log_opt = f"-Dlog4j2.configurationFile=file:{log4j_config()}"
    b = (SparkSession.builder.master(master).appName(app_name)
         .config("spark.ui.enabled", "true" if ui else "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.session.timeZone", "UTC")
         .config("spark.python.worker.reuse", "true")
         .config("spark.sql.execution.arrow.pyspark.enabled", "true")
         .config("spark.driver.extraJavaOptions", log_opt)
         .config("spark.executor.extraJavaOptions", log_opt)
         .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
         .config("spark.executorEnv.PYSPARK_PYTHON", os.environ["PYSPARK_PYTHON"]))
    if local:
        b = (b.config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.sql.shuffle.partitions", str(shuffle_partitions or max(2, cores)))
             .config("spark.default.parallelism", str(max(2, cores))))
    elif shuffle_partitions:
        b = b.config("spark.sql.shuffle.partitions", str(shuffle_partitions))
    for k, v in (conf or {}).items():
        b = b.config(k, str(v))
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    spark.dataSource.register(WrenDataSource)
    return spark
