"""The compiled hot path (setup.py, meshmq/compiled.py): the two lists of modules agree, and a
module is either compiled with the whole group or plain Python."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from meshmq.compiled import HOT_PATH, compiled_modules, describe

ROOT = Path(__file__).resolve().parents[1]


def test_setup_compiles_exactly_the_modules_the_version_reports_on() -> None:
    listed = re.findall(r'^    "(meshmq/[\w/]+)\.py",$', (ROOT / "setup.py").read_text(), re.M)
    assert tuple(path.replace("/", ".") for path in listed) == HOT_PATH


def test_the_hot_path_is_all_compiled_or_all_plain_python() -> None:
    compiled = compiled_modules()
    assert compiled in ([], list(HOT_PATH)), compiled  # mypyc builds them as one group
    for name in HOT_PATH:
        source = Path(importlib.import_module(name).__file__ or "")
        assert source.suffix in (".py", ".so"), source
    assert describe() == ("pure Python" if not compiled
                          else f"compiled hot path ({len(HOT_PATH)} of {len(HOT_PATH)} modules)")
