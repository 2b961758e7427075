"""Spark pipeline over the meshmq commit log.

``register(spark)`` makes ``spark.read.format("meshmq")`` and ``spark.readStream.format("meshmq")``
available; see docs/pipeline.md.
"""

from __future__ import annotations

from typing import Any

from meshmq.pipeline.schema import SCHEMA, SCHEMA_DDL

SHORT_NAME = "meshmq"


def register(spark: Any) -> None:
    """Register the ``meshmq`` data source with ``spark`` (a SparkSession); idempotent."""
    from meshmq.pipeline.source import MeshmqDataSource

    spark.dataSource.register(MeshmqDataSource)


__all__ = ["SCHEMA", "SCHEMA_DDL", "SHORT_NAME", "register"]
