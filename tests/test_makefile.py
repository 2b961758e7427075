"""What ``make serve``, ``make demo`` and ``make test`` install, in which order, and when again.

Run on a copy of the Makefile and pyproject.toml with ``PIP`` replaced by ``echo``, so the
stamps and the dependency logic are real and nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BROKER = "-e ."
SPARK = "-e .[spark]"
TEST = "-e .[test,spark]"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """The Makefile and pyproject.toml, with a virtualenv whose meshmq only says it ran."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("python", "meshmq"):
        (bin_dir / tool).write_text(f"#!/bin/sh\necho ran {tool} \"$@\"\n")
        (bin_dir / tool).chmod(0o755)
    return tmp_path


def make(checkout: Path, *targets: str) -> str:
    """Run make (``-s``: commands are not echoed), PIP only saying what it would install;
    return what the commands printed, or with ``-n`` the commands."""
    result = subprocess.run(["make", "-s", "PIP=echo installing", *targets],
                            cwd=checkout, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def installs(output: str) -> list[str]:
    """What pip was asked to install; with ``make -n``, what it would be (printed as the
    command, quotes included: echo drops them)."""
    lines = (line.removeprefix("echo ") for line in output.splitlines())
    return [line.removeprefix("installing ").replace("'", "") for line in lines
            if line.startswith("installing ")]


def test_serve_installs_only_the_broker(checkout: Path) -> None:
    output = make(checkout, "serve")
    assert installs(output) == [BROKER]
    assert "ran meshmq serve" in output
    assert installs(make(checkout, "serve")) == []  # done once


def test_demo_installs_the_spark_extra(checkout: Path) -> None:
    output = make(checkout, "demo")
    assert installs(output) == [SPARK]
    assert "ran meshmq pipeline demo" in output


def test_test_installs_the_test_and_spark_extras(checkout: Path) -> None:
    output = make(checkout, "-n", "test")  # -n: the suite itself is not run here
    assert installs(output) == [TEST]
    assert "pytest" in output


def test_serve_then_test_then_serve(checkout: Path) -> None:
    assert installs(make(checkout, "serve")) == [BROKER]
    assert installs(make(checkout, ".venv/.installed-test")) == [TEST]
    assert installs(make(checkout, "serve")) == []
    assert installs(make(checkout, "demo")) == []  # the test set holds the spark extra


def test_demo_then_serve_then_test(checkout: Path) -> None:
    assert installs(make(checkout, "demo")) == [SPARK]
    assert installs(make(checkout, "serve")) == []
    assert installs(make(checkout, "-n", "test")) == [TEST]


def test_a_changed_pyproject_installs_again(checkout: Path) -> None:
    make(checkout, ".venv/.installed-test")
    pyproject = checkout / "pyproject.toml"
    later = pyproject.stat().st_mtime + 60
    os.utime(pyproject, (later, later))
    assert installs(make(checkout, "serve")) == [BROKER]
    assert installs(make(checkout, "-n", "test")) == [TEST]


def test_a_changed_compiled_module_installs_again(checkout: Path) -> None:
    """setup.py compiles some modules in place: an edit to one must build them again, or the
    tests would run the code as it was."""
    shutil.copy(ROOT / "setup.py", checkout / "setup.py")
    codec = checkout / "src" / "meshmq" / "mqtt" / "codec.py"
    codec.parent.mkdir(parents=True)
    for source in (codec, checkout / "src" / "meshmq" / "compiled.py"):
        shutil.copy(ROOT / source.relative_to(checkout), source)
    make(checkout, ".venv/.installed-test")
    assert installs(make(checkout, "serve")) == []
    later = codec.stat().st_mtime + 60
    os.utime(codec, (later, later))
    assert installs(make(checkout, "serve")) == [BROKER]


def test_test_and_lint_type_check_src_after_ruff(checkout: Path) -> None:
    """``make test``: ruff, then mypy (over src/, as pyproject.toml's [tool.mypy] says), then
    the bytecode of src/ and tests/ (the processes the tests start load it), then pytest;
    ``make lint``: ruff, then mypy."""
    def position(commands: list[str], tool: str) -> int:
        return next(i for i, line in enumerate(commands) if line.split()[0].endswith(tool))

    commands = make(checkout, "-n", "test").splitlines()
    assert (position(commands, "/ruff") < position(commands, "/mypy")
            < position(commands, "/python"))
    runs = [line.split()[1:] for line in commands if line.split()[0].endswith("/python")]
    assert [run[:2] for run in runs][:2] == [["-m", "compileall"], ["-m", "pytest"]]
    assert runs[0][2:5] == ["-q", "src", "tests"]
    # then the compiled modules' tests again as plain Python, from a copy without the .so files
    pure = next(line for line in commands
                if line.startswith("PYTHONPATH=build/pure ") and " pytest " in line)
    assert pure.split()[1:4] == [".venv/bin/python", "-m", "pytest"]
    commands = make(checkout, "-n", "lint").splitlines()
    assert position(commands, "/ruff") < position(commands, "/mypy")
