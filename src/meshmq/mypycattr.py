"""``mypyc_attr`` for modules that may be compiled with mypyc, without a runtime dependency.

mypyc reads ``@mypyc_attr(...)`` from the source (it resolves to ``mypy_extensions.mypyc_attr``
for the type checker); interpreted, the decorator must still exist, and mypy_extensions is no
dependency of meshmq (it comes with mypy, a test tool): without it, it returns the class as is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr as mypyc_attr
else:
    try:
        from mypy_extensions import mypyc_attr
    except ImportError:

        def mypyc_attr(*attrs, **kwattrs):
            return lambda decorated: decorated
