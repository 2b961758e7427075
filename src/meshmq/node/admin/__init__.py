"""The operations plane: Prometheus metrics, the admin API and the dashboard (docs/operations.md).

``app.py`` serves them on ``admin.listen`` from worker 0 (or the single process); ``views.py``
asks every worker through the mesh (cluster/admin.py) and each worker answers from its broker
(broker/queries.py, ``collect.py``); ``metrics.py`` adds the workers' counters up into one view.
"""

from __future__ import annotations

from meshmq.node.startup import CANNOT_START, StartupError


class AdminError(StartupError):
    """The admin listener cannot start; the message is one line naming the problem, and
    ``exit_status`` the exit status (2: a bad file in the configuration)."""

    def __init__(self, message: str, status: int = CANNOT_START) -> None:
        super().__init__(message, status)
