"""Build meshmq, with the hot path of a message compiled by mypyc when it can be.

The modules of ``meshmq.compiled.HOT_PATH`` (the codec, the connection, the publish path, the
commit log's append path: docs/benchmarks.md, "A compiled core") are compiled to C extensions
by mypyc when the build has mypyc (a build requirement in pyproject.toml) and a C compiler.
Without either, or with ``MESHMQ_PURE_PYTHON=1`` in the environment, the install is the same
modules as plain Python, which behave the same and pass the same tests (``make test`` runs
both). A compile that fails leaves the plain Python modules in use and says so in the build
output.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
# The modules to compile: meshmq/compiled.py's HOT_PATH, the one list (``meshmq --version`` and
# the Makefile read it too); run as a file, since the build has none of meshmq's dependencies.
HOT_PATH = runpy.run_path(str(HERE / "src" / "meshmq" / "compiled.py"))["HOT_PATH"]
COMPILED = [name.replace(".", "/") + ".py" for name in HOT_PATH]


def note(message: str) -> None:
    print(f"meshmq build: {message}", file=sys.stderr)


def remove_compiled(src: Path = HERE / "src") -> None:
    """Delete every extension an earlier install built in place (an editable install, as
    ``make`` does): without this, a plain Python install would go on importing them, and a
    module taken off ``HOT_PATH`` would go on importing its old extension. The group's shared
    libraries (``src/<hash>__mypyc.*.so``, one per list of modules) go too."""
    stale = list(src.glob("*__mypyc.*.so")) + list(src.glob("meshmq/**/*.so"))
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
    cwd = os.getcwd()
    os.chdir(HERE / "src")  # module names from the package tree (meshmq.mqtt.codec ...)
    try:
        # The build environment has none of the runtime dependencies: their types are Any.
        return mypycify(["--ignore-missing-imports", *COMPILED], opt_level="3",
                        target_dir=str(HERE / "build" / "mypyc"))
    except BaseException as error:  # mypyc exits on a type error: keep the plain modules
        note(f"mypyc could not compile the hot path ({error!r}): plain Python modules only")
        return []
    finally:
        os.chdir(cwd)


class OptionalBuildExt(build_ext):
    """Builds the compiled modules if it can; without a working C compiler the install goes
    on with the plain Python modules (the extensions are an acceleration, not a need)."""

    def run(self) -> None:
        if self.inplace or getattr(self, "editable_mode", False):  # into src/, as make does
            remove_compiled()  # what an earlier list of modules built there goes first
        try:
            super().run()
        except Exception as error:  # no compiler, missing headers: setuptools' own errors
            note(f"the compiled modules were not built ({error}): plain Python modules only")
            self._remove_partial()

    def _remove_partial(self) -> None:
        """A compiled module needs the shared library of the group: all or none stay."""
        for output in self.get_outputs():
            Path(output).unlink(missing_ok=True)
        remove_compiled()


def extensions() -> list:
    """The compiled modules to build (mypyc writes their C, with absolute paths, under
    build/mypyc), or none, after removing what an earlier install built in place."""
    compiled = compiled_extensions()
    if not compiled:
        remove_compiled()
    return compiled


if __name__ == "__main__":  # as pip's build backend and ``python setup.py`` run it
    setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
