"""Sample meshmq with py-spy during a scenario's window and say where the time went.

``py-spy record --format raw --threads`` writes collapsed stacks (``thread (tid): name;frame;
...;leaf count``), one line per distinct stack. ``summarise()`` turns them into each thread's
share of the samples and two rankings over the samples of all threads: *self* time (the
function on top of the stack, i.e. where the thread actually was) and *inclusive* time (the
function anywhere on the stack, i.e. what it cost with everything it called; the start-up
chain every stack shares, such as runpy, the CLI and ``uvloop.run``, is left out). A thread
blocked in epoll is idle and not sampled (no ``--idle``), but one inside a blocking system call
such as ``fsync`` counts as busy, so the percentages are of non-idle time, not of CPU time.
"""

from __future__ import annotations

import math
import re
import shutil
import signal
import subprocess
from collections import Counter
from pathlib import Path

from meshbench import BenchError

RATE = 250  # samples per second
# Frames that every stack of a thread shares (how the process or thread started): not news.
ENTRY = ("<frozen runpy>", "threading.py:Thread._bootstrap", "threading.py:Thread.run",
         "meshmq/cli.py:", "meshmq/__main__.py:", "uvloop/__init__.py:run",
         "asyncio/runners.py:", "meshmq/node/server.py:run_server")
_PREFIX = re.compile(r"^.*/(?:src|site-packages|lib/python3\.\d+)/")
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def find_py_spy() -> str:
    candidates = [Path(__file__).resolve().parents[2] / ".venv" / "bin" / "py-spy"]
    for path in candidates:
        if path.exists():
            return str(path)
    found = shutil.which("py-spy")
    if found is None:
        raise BenchError("py-spy not found: pip install -e '.[test]' (it pins py-spy==0.4.3)")
    return found


def start(pid: int, seconds: float, out: Path, cpus: str | None) -> subprocess.Popen:
    """Start sampling ``pid`` for ``seconds``; wait on the returned process, then
    ``summarise(out)``. ``--nonblocking`` keeps py-spy from pausing the broker to read it."""
    cmd = [find_py_spy(), "record", "--pid", str(pid), "--duration", str(math.ceil(seconds)),
           "--rate", str(RATE), "--format", "raw", "--output", str(out), "--nonblocking",
           "--threads"]
    if cpus is not None:
        cmd = ["taskset", "-c", cpus, *cmd]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def short_frame(frame: str) -> str:
    """``on_publish (/x/src/meshmq/broker/broker.py:120)`` -> ``meshmq/broker/broker.py:on_publish``
    (line numbers dropped so one function is one entry)."""
    match = _FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    path = _PREFIX.sub("", match["file"])  # py-spy often shortens paths like this itself
    return f"{path}:{match['func']}"


def summarise(raw: Path, top: int = 20) -> dict[str, object]:
    """Rank functions by self and inclusive share of the samples in ``raw``."""
    own: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        thread = "?"
        if frames[0].startswith("thread ("):
            head = frames.pop(0)
            thread = head.partition("): ")[2] or head
        frames = [short_frame(f) for f in frames if not f.startswith("process ")]
        if not frames:
            continue
        total += count
        threads[thread] += count
        own[frames[-1]] += count
        for name in set(frames):
            if not name.startswith(ENTRY):
                anywhere[name] += count

    def ranked(counter: Counter[str], limit: int = top) -> list[list[object]]:
        return [[name, round(100.0 * n / total, 1)] for name, n in counter.most_common(limit)]

    if not total:
        return {"samples": 0, "threads": [], "self": [], "inclusive": []}
    return {"samples": total, "threads": ranked(threads, 10), "self": ranked(own),
            "inclusive": ranked(anywhere)}


def render(title: str, summary: dict[str, object]) -> str:
    threads = ", ".join(f"{name} {pct}%" for name, pct in summary["threads"])  # type: ignore[attr-defined]
    lines = [f"{title}: {summary['samples']} samples ({threads})"]
    for kind in ("self", "inclusive"):
        lines.append(f"  top {kind} time:")
        lines += [f"    {pct:5.1f}%  {name}" for name, pct in summary[kind]]  # type: ignore[union-attr]
    return "\n".join(lines)


def stop(process: subprocess.Popen) -> None:
    """End a recording started with a long duration now: py-spy writes its output on SIGINT
    (the caller still waits on it)."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
