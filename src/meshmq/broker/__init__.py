"""Broker I/O, sessions and routing for one node."""
