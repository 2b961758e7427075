"""The ``spark-submit`` entry point: the same jobs and options as ``meshmq pipeline``.

    spark-submit --master spark://host:7077 "$(python -c \\
        'import meshmq.pipeline.jobs.submit as m; print(m.__file__)')" telemetry --data-dir ...

``--master`` defaults to spark-submit's own. meshmq must be installed (not only shipped with
``--py-files``) wherever the driver runs: see docs/pipeline.md, "Running on a cluster".
"""

from __future__ import annotations

import sys
from pathlib import Path

# Python puts this file's directory first on sys.path; its module names (report, rules, ...)
# must not shadow top-level modules.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    del sys.path[0]

from meshmq.pipeline.cli import main as pipeline_main


def main(argv: list[str] | None = None) -> int:
    return pipeline_main(argv, prog="submit.py", master=None)


if __name__ == "__main__":
    sys.exit(main())
