"""The Spark jobs built on the ``meshmq`` data source (``meshmq pipeline ...``).

``telemetry``  JSON telemetry -> per-device window aggregates, bad payloads quarantined
``archive``    raw records -> Parquet partitioned by date and topic root
``alerts``     threshold ``rules`` over the aggregates -> MQTT (``publisher``), at most once
               per window and rule (``ledger``)
``report``     a PNG and an HTML page (``report_model``: what they show; ``report_plot``,
               ``report_html``: drawing and page)
``demo``       simulated devices (``demo_fleet``), then telemetry, alerts and report
``common``     sessions, options, topic filters; ``interrupts`` (Ctrl-C); ``submit`` is the
               spark-submit entry

Every job is a function of a SparkSession and an options dataclass; ``meshmq.pipeline.cli``
builds both from the command line. docs/pipeline.md ("Jobs") is the user's guide.
"""
