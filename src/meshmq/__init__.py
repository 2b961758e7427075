"""meshmq: a distributed MQTT broker with a commit log at its core."""

__version__ = "0.1.0"
