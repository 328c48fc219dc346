"""One place that builds the SparkSession the pipeline's commands use.

``local[*]`` by default; any ``--master`` URL (``spark://``, ``yarn``,
``k8s://``) works as well, since nothing here assumes the driver and the
executors share a machine. For ``local`` masters the Python workers run the
driver's own interpreter (so they see the same installed packages); on a
real cluster ``PYSPARK_PYTHON`` or the cluster's configuration decides, and
the executors need this project installed (``pip install dledger-py[spark]``)
or shipped with ``--py-files``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from pyspark.sql import SparkSession

LOCAL_DEFAULTS = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.session.timeZone": "UTC",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
}


def build_session(
    master: str = "local[*]",
    app_name: str = "dledger-pipeline",
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """A SparkSession with the ``dledger`` format registered."""
    from pipeline.source import register

    b = SparkSession.builder.master(master).appName(app_name)
    local = master.startswith("local")
    settings: dict[str, str] = {"spark.sql.session.timeZone": "UTC"}
    if local:
        settings.update(LOCAL_DEFAULTS)
        # The data source planner's Python workers read the environment, not
        # spark.pyspark.python, so the variable it is.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    settings.update(conf or {})
    for k, v in settings.items():
        b = b.config(k, v)
    spark = b.getOrCreate()
    register(spark)
    return spark
