"""The compiled hot path (setup.py, meshmq/compiled.py): the list of modules names real sources,
and a module is either compiled with the whole group or plain Python."""

from __future__ import annotations

import importlib
import re
import runpy
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


def test_setup_removes_every_extension_an_earlier_build_left_in_the_tree(tmp_path: Path) -> None:
    # A module taken off HOT_PATH, or a pure Python install after a compiled one, must not go
    # on importing an extension built in place earlier (an editable install).
    setup = runpy.run_path(str(ROOT / "setup.py"), run_name="meshmq_setup")
    package = tmp_path / "meshmq" / "log"
    package.mkdir(parents=True)
    suffix = ".cpython-311-x86_64-linux-gnu.so"
    built = [tmp_path / f"0123456789abcdef0123__mypyc{suffix}",
             tmp_path / "meshmq" / f"codec{suffix}", package / f"taken_off{suffix}"]
    kept = [package / "taken_off.py", tmp_path / "meshmq" / "codec.py", tmp_path / "other.txt"]
    for path in built + kept:
        path.write_bytes(b"")
    setup["remove_compiled"](tmp_path)
    assert [path for path in built if path.exists()] == []
    assert [path for path in kept if not path.exists()] == []
