"""Build meshmq, with the hot path of a message compiled by mypyc when it can be.

The modules in ``COMPILED`` (the codec, the connection, the publish path, the commit log's
append path: docs/benchmarks.md, "A compiled core") are compiled to C extensions by mypyc when
the build has mypyc (a build requirement in pyproject.toml) and a C compiler. Without either,
or with ``MESHMQ_PURE_PYTHON=1`` in the environment, the install is the same modules as plain
Python, which behave the same and pass the same tests (``make test`` runs both). A compile
that fails leaves the plain Python modules in use and says so in the build output.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

COMPILED = [
    "meshmq/mqtt/codec.py",
    "meshmq/mqtt/connection.py",
    "meshmq/broker/publishes.py",
    "meshmq/broker/session.py",
    "meshmq/broker/router.py",
    "meshmq/broker/message.py",
    "meshmq/broker/persistence.py",
    "meshmq/broker/trie.py",
    "meshmq/broker/local.py",
    "meshmq/broker/transport/protocol.py",
    "meshmq/log/record.py",
    "meshmq/log/writer.py",
    "meshmq/log/partition.py",
    "meshmq/log/segment.py",
    "meshmq/log/commit_log.py",
]


def note(message: str) -> None:
    print(f"meshmq build: {message}", file=sys.stderr)


def remove_compiled() -> None:
    """Delete the extensions an earlier install built in place (an editable install, as
    ``make`` does): without this, a plain Python install would go on importing them."""
    src = Path(__file__).resolve().parent / "src"
    stale = list(src.glob("*__mypyc.*.so"))
    for path in COMPILED:
        source = src / path
        stale += source.parent.glob(f"{source.stem}.*.so")
    for path in stale:
        path.unlink(missing_ok=True)


def compiled_extensions() -> list:
    if os.environ.get("MESHMQ_PURE_PYTHON", "") not in ("", "0"):
        note("MESHMQ_PURE_PYTHON is set: plain Python modules only")
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        note("mypyc is not available: plain Python modules only")
        return []
    here = Path(__file__).resolve().parent
    cwd = os.getcwd()
    os.chdir(here / "src")  # module names from the package tree (meshmq.mqtt.codec ...)
    try:
        # The build environment has none of the runtime dependencies: their types are Any.
        return mypycify(["--ignore-missing-imports", *COMPILED], opt_level="3",
                        target_dir=str(here / "build" / "mypyc"))
    except BaseException as error:  # mypyc exits on a type error: keep the plain modules
        note(f"mypyc could not compile the hot path ({error!r}): plain Python modules only")
        return []
    finally:
        os.chdir(cwd)


class OptionalBuildExt(build_ext):
    """Builds the compiled modules if it can; without a working C compiler the install goes
    on with the plain Python modules (the extensions are an acceleration, not a need)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as error:  # no compiler, missing headers: setuptools' own errors
            note(f"the compiled modules were not built ({error}): plain Python modules only")
            self._remove_partial()

    def build_extension(self, ext) -> None:  # type: ignore[no-untyped-def]
        try:
            super().build_extension(ext)
        except Exception as error:
            note(f"{ext.name} was not built ({error}): plain Python modules only")
            self._remove_partial()
            raise

    def _remove_partial(self) -> None:
        """A compiled module needs the shared library of the group: all or none stay."""
        for output in self.get_outputs():
            Path(output).unlink(missing_ok=True)
        remove_compiled()


def extensions_with_sources() -> list:
    extensions = compiled_extensions()
    if not extensions:
        remove_compiled()
    for extension in extensions:  # mypyc wrote the C under src/: paths from the project root
        extension.sources = [source if os.path.isabs(source) else os.path.join("src", source)
                             for source in extension.sources]
        extension.include_dirs = [path if os.path.isabs(path) else os.path.join("src", path)
                                  for path in extension.include_dirs]
    return extensions


setup(ext_modules=extensions_with_sources(), cmdclass={"build_ext": OptionalBuildExt})
