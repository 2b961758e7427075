"""The compiled hot path (setup.py, meshmq/compiled.py): the list of modules names real sources,
and a module is either compiled with the whole group or plain Python."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from meshmq.compiled import HOT_PATH, compiled_modules, describe

ROOT = Path(__file__).resolve().parents[1]


def test_the_list_names_source_files_one_a_line_as_setup_and_the_makefile_read_it() -> None:
    for name in HOT_PATH:  # setup.py compiles src/<name as a path>.py
        assert (ROOT / "src" / (name.replace(".", "/") + ".py")).is_file(), name
    text = (ROOT / "src" / "meshmq" / "compiled.py").read_text()
    assert tuple(re.findall(r'^    "(meshmq\.[a-z_.]*)",$', text, re.M)) == HOT_PATH  # Makefile


def test_the_hot_path_is_all_compiled_or_all_plain_python() -> None:
    compiled = compiled_modules()
    assert compiled in ([], list(HOT_PATH)), compiled  # mypyc builds them as one group
    for name in HOT_PATH:
        source = Path(importlib.import_module(name).__file__ or "")
        assert source.suffix in (".py", ".so"), source
    assert describe() == ("pure Python" if not compiled
                          else f"compiled hot path ({len(HOT_PATH)} of {len(HOT_PATH)} modules)")
