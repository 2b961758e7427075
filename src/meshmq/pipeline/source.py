"""``MeshmqDataSource``: the ``meshmq`` PySpark data source (batch and streaming).

Register it with ``meshmq.pipeline.register(spark)``, then::

    spark.read.format("meshmq").load("/var/lib/meshmq")            # data_dir or data_dir/log
    spark.readStream.format("meshmq").option("startingOffsets", "earliest").load(data_dir)

The schema is ``meshmq.pipeline.schema.SCHEMA``; options are in ``options.py`` and
docs/pipeline.md. The source reads the broker's files directly and read-only (``logdir.py``):
no broker process, no lock, no connector JAR. It must be importable on the driver and the
executors as an installed package (``pip install meshmq[spark]``).
"""

from __future__ import annotations

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader
from pyspark.sql.types import StructType

from meshmq.pipeline.errors import SourceOptionError
from meshmq.pipeline.options import parse_options
from meshmq.pipeline.reader import MeshmqBatchReader
from meshmq.pipeline.schema import SCHEMA, SCHEMA_DDL
from meshmq.pipeline.stream import MeshmqStreamReader


class MeshmqDataSource(DataSource):
    """Spark's entry point; options are parsed (and refused) when a reader is made."""

    @classmethod
    def name(cls) -> str:
        return "meshmq"

    def schema(self) -> StructType:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        _check_schema(schema)
        return MeshmqBatchReader(parse_options(self.options, streaming=False))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        _check_schema(schema)
        return MeshmqStreamReader(parse_options(self.options, streaming=True))


def _check_schema(schema: StructType) -> None:
    """Refuse a user-specified schema: the columns are fixed by the log format."""
    if [(f.name, f.dataType) for f in schema.fields] != [
            (f.name, f.dataType) for f in SCHEMA.fields]:
        raise SourceOptionError(
            f"the meshmq source has a fixed schema ({SCHEMA_DDL}); do not pass .schema(...)"
            f" (got {schema.simpleString()})")
