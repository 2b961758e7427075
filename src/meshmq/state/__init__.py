"""The state store: the broker's small durable state, a JSON snapshot plus an fsynced journal.

A storage engine beside the commit log (``log/``): it stores JSON records (one per persistent
session, one per retained topic) and knows nothing of the broker's types; the broker's
``keeper.py`` turns sessions and retained messages into records and back (with
``broker/snapshot.py``, the one codec of a session).

* ``store.py``: ``StateStore``, the owner of one state directory and the thread that writes it;
* ``files.py``: the files' format and their one reader (snapshot, journal lines);
* ``check.py``: ``verify`` and ``repair``; ``cli.py``: ``meshmq state verify|repair``.
"""
