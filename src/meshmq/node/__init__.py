"""The composition root: start-up, supervision of worker processes and signals.

The only package that knows every layer and wires them together (docs/architecture.md):
``server.py`` runs a node (or one worker of it), ``supervisor.py`` keeps a node's worker
processes. Nothing but the command line imports it.
"""
