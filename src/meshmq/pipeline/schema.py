"""The row schema of the ``meshmq`` Spark data source.

Columns, in order (modelled on Spark's Kafka source):

==============  ========================  ==============================================
column          type                      meaning
==============  ========================  ==============================================
partition       int                       log partition (topic group) of the record
offset          long                      offset of the record within its partition
timestamp       timestamp (UTC)           broker append time (microsecond precision)
topic           string                    MQTT topic name the message was published to
qos             int                       QoS the publisher used (0, 1 or 2)
retain          boolean                   the publisher's RETAIN flag
payload         binary                    the application message, untouched
client_id       string                    client identifier of the publisher
message_id      string                    128-bit time-ordered message id, 32 hex chars
properties      map<string,string>        MQTT 5 properties (see below)
==============  ========================  ==============================================

``properties`` holds every MQTT 5 user property (name -> value; if a name repeats, the last
value wins) plus these well-known keys when the publish carried them:
``content_type``, ``response_topic``, ``correlation_data`` (hex), ``payload_format``
(``"0"`` bytes / ``"1"`` UTF-8) and ``message_expiry`` (seconds, decimal).
"""

from __future__ import annotations

from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

SCHEMA_DDL = (
    "partition INT, offset BIGINT, timestamp TIMESTAMP, topic STRING, qos INT, "
    "retain BOOLEAN, payload BINARY, client_id STRING, message_id STRING, "
    "properties MAP<STRING, STRING>"
)

SCHEMA = StructType(
    [
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
        StructField("topic", StringType()),
        StructField("qos", IntegerType()),
        StructField("retain", BooleanType()),
        StructField("payload", BinaryType()),
        StructField("client_id", StringType()),
        StructField("message_id", StringType()),
        StructField("properties", MapType(StringType(), StringType())),
    ]
)

#: Well-known MQTT 5 properties copied into the ``properties`` map, by key.
WELL_KNOWN_PROPERTIES = (
    "content_type",
    "response_topic",
    "correlation_data",
    "payload_format",
    "message_expiry",
)

__all__ = ["SCHEMA", "SCHEMA_DDL", "WELL_KNOWN_PROPERTIES"]
