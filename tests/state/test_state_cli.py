"""``meshmq state verify|repair``: real state directories written by ``StateStore``, damaged,
checked and repaired through the command line (in-process for speed, a subprocess where the
exit status and stderr of the real command matter)."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshmq.cli import main
from meshmq.state.files import apply, empty_state
from meshmq.state.store import StateStore


def cli(*args: str) -> tuple[int, str, str]:
    """Run ``meshmq state ARGS`` in-process; (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(["state", *args])
        except SystemExit as exc:  # argparse usage errors
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def run_meshmq(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshmq", *args], capture_output=True,
                          text=True, timeout=60, cwd=cwd, stdin=subprocess.DEVNULL)


def session(n: int) -> dict:
    return {"op": "session", "client_id": f"c{n % 4}", "expiry": n, "cursor": [n, n]}


def subs(n: int) -> dict:
    return {"op": "subs", "client_id": f"c{n % 4}",
            "subs": {f"t/{n % 3}": [n % 3, False, False, 0, None]}}


def retain(n: int) -> dict:
    return {"op": "retain", "topic": f"r/{n % 2}", "message": {"payload": str(n)}}


ENTRY_KINDS = (session, subs, retain)


def write_state(data_dir: Path, entries: list[dict], name: str = "state") -> Path:
    """Journal ``entries`` with a real store (closed without compaction, as after kill -9)."""
    loop = asyncio.new_event_loop()
    try:
        store = StateStore(data_dir, loop, name)
        store.load()
        for entry in entries:
            store.write(entry)
        store.close()
    finally:
        loop.close()
    return next((data_dir / name).glob("journal-*.jsonl"))


def load_state(data_dir: Path, name: str = "state") -> dict:
    loop = asyncio.new_event_loop()
    try:
        store = StateStore(data_dir, loop, name)
        state = store.load()
        store.close()
    finally:
        loop.close()
    return state


def expected_state(entries: list[dict]) -> dict:
    state = empty_state()
    for entry in entries:
        apply(state, entry)
    return state


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != ".lock"}


DAMAGE = [b"{garbage", b'{"op":"nonsense"}', b'{"op":"subs","client_id":"c1"}', b"\x00\xff\x17",
          b'["op","end"]', b'{"op":"retain","topic":7,"message":null}']


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(count=st.integers(1, 25), data=st.data())
def test_verify_finds_every_bad_line_and_repair_keeps_every_good_one(
        tmp_path_factory, count: int, data) -> None:
    """Whatever lines are damaged (and whether the end is torn), verify names exactly those
    lines, repair cuts exactly those, the broker's store then loads the state that the good
    entries give in order, and the journal as it was is kept."""
    data_dir = tmp_path_factory.mktemp("data")
    kinds = data.draw(st.lists(st.sampled_from(ENTRY_KINDS), min_size=count, max_size=count))
    entries = [kind(n) for n, kind in enumerate(kinds)]
    journal = write_state(data_dir, entries)
    bad = data.draw(st.sets(st.integers(0, count - 1), max_size=count))
    lines = journal.read_bytes().split(b"\n")[:-1]
    for n in bad:
        lines[n] = data.draw(st.sampled_from(DAMAGE))
    end = data.draw(st.sampled_from([b"", b'{"op":"end","cl', b'{"op":"end","client_id":"c1"}']))
    torn = end.endswith(b"cl")  # a torn write; the other is a whole entry that lost its newline
    damaged = b"".join(line + b"\n" for line in lines) + end

    journal.write_bytes(damaged)
    code, out, _ = cli("verify", "-d", str(data_dir), "--json")
    report = json.loads(out)
    problems = report["directories"][0]["problems"]
    found = [(p["line"], p["kind"]) for p in problems]
    assert found == [(n + 1, "damaged") for n in sorted(bad)] + ([(count + 1, "torn")] if torn
                                                                 else [])
    assert code == (1 if found else 0) and report["clean"] is (not found)

    code, out, err = cli("repair", "-d", str(data_dir))
    assert (code, err) == (0, "")
    good = [entry for n, entry in enumerate(entries) if n not in bad]
    good += [{"op": "end", "client_id": "c1"}] if end and not torn else []
    assert journal.read_bytes() == b"".join(line + b"\n" for n, line in enumerate(lines)
                                            if n not in bad) + (b"" if torn else end)
    kept = list((data_dir / "state").glob(f"repair-backup-*/{journal.name}"))
    assert [k.read_bytes() for k in kept] == ([damaged] if found else [])
    assert load_state(data_dir) == expected_state(good)
    assert cli("verify", "-d", str(data_dir))[0] == 0


def test_an_operation_that_is_not_a_string_is_a_damaged_line(tmp_path: Path) -> None:
    """An "op" that JSON decodes to a list or an object (unhashable) is reported like any
    other bad line, not a crash."""
    journal = write_state(tmp_path, [session(1), session(2), session(3)])
    lines = journal.read_bytes().split(b"\n")
    lines[0] = b'{"op":["session"],"client_id":"c1"}'
    lines[2] = b'{"op":{"session":1},"client_id":"c3"}'
    journal.write_bytes(b"\n".join(lines))
    code, out, err = cli("verify", "-d", str(tmp_path))
    assert (code, err) == (1, "")
    assert (f"problem: {journal}:1: damaged line (unknown state operation ['session'])"
            in out)
    assert (f"problem: {journal}:3: damaged line (unknown state operation {{'session': 1}})"
            in out)
    assert cli("repair", "-d", str(tmp_path))[0] == 0
    assert load_state(tmp_path) == expected_state([session(2)])


def test_repair_text_names_each_line_cut_and_the_copy(tmp_path: Path) -> None:
    journal = write_state(tmp_path, [session(1), subs(1), retain(1)])
    lines = journal.read_bytes().split(b"\n")
    lines[1] = b'{"op":"subs","client_id":"c1","subs":{"t/1":[1,fal\x1b'
    journal.write_bytes(b"\n".join(lines))
    code, out, _ = cli("verify", "-d", str(tmp_path))
    assert code == 1
    assert (f"problem: {journal}:2: damaged line (Expecting value: line 1 column 48 (char 47)); "
            'the broker refuses to start: {"op":"subs","client_id":"c1","subs":{"t/1":[1,fal\\x1b'
            ) in out
    assert out.splitlines()[-1] == "verify: 1 problem (1 state directory)"
    before = files(tmp_path)
    code, out, _ = cli("repair", "-d", str(tmp_path), "--dry-run")
    assert code == 0 and f"{journal}:2: would cut out (damaged)" in out
    assert out.splitlines()[-1] == "repair --dry-run: nothing changed; a repair would cut 1 line"
    assert files(tmp_path) == before
    code, out, _ = cli("repair", "-d", str(tmp_path))
    kept = next((tmp_path / "state").glob("repair-backup-*")) / journal.name
    assert code == 0 and f"{journal}:2: cut out (damaged)" in out
    assert f"the journal as it was: {kept}" in out
    assert out.splitlines()[-1] == "repair: cut 1 line from 1 journal; verify is now clean"
    assert cli("repair", "-d", str(tmp_path))[1] == "repair: nothing to do (verify is clean)\n"


def test_worker_state_directories_are_checked_and_repaired(tmp_path: Path) -> None:
    write_state(tmp_path, [session(0)])
    journal = write_state(tmp_path, [session(1), session(2), session(3)], "state-1")
    lines = journal.read_bytes().split(b"\n")
    lines[0] = b"{garbage"
    journal.write_bytes(b"\n".join(lines))
    code, out, _ = cli("verify", "-d", str(tmp_path))
    assert code == 1 and f"problem: {journal}:1: damaged line" in out
    assert out.splitlines()[-1] == "verify: 1 problem (2 state directories)"
    assert cli("repair", "-d", str(tmp_path))[0] == 0
    assert load_state(tmp_path, "state-1") == expected_state([session(2), session(3)])
    code, out, _ = cli("verify", "-d", str(tmp_path / "state-1"))  # one directory, by name
    assert code == 0 and out.splitlines()[-1] == "verify: clean (1 state directory)"


def test_a_damaged_snapshot_is_reported_and_left_alone(tmp_path: Path) -> None:
    write_state(tmp_path, [session(1)])
    snapshot = tmp_path / "state" / "snapshot.json"
    snapshot.write_text('{"version": 1, "generation": 0, "sessions": {"c1": ')
    code, out, _ = cli("verify", "-d", str(tmp_path))
    assert code == 1 and f"problem: {snapshot}: not a meshmq state snapshot (" in out
    before = files(tmp_path)
    code, out, _ = cli("repair", "-d", str(tmp_path))
    assert code == 1 and out.startswith(f"cannot repair: {snapshot}: ")
    assert "restore it from a backup, or move its directory away" in out
    assert files(tmp_path) == before


def test_repair_is_refused_while_a_broker_holds_the_directory(tmp_path: Path) -> None:
    journal = write_state(tmp_path, [session(1), session(2)])
    loop = asyncio.new_event_loop()
    holder = StateStore(tmp_path, loop)
    holder.load()  # what a running broker holds
    try:
        journal.write_bytes(b"{garbage\n" + journal.read_bytes())
        before = files(tmp_path)
        refused = run_meshmq("state", "repair", "-d", str(tmp_path))
        assert refused.returncode == 2 and refused.stdout == ""
        assert refused.stderr == (f"meshmq state: error: {tmp_path / 'state'} is in use (a "
                                  "running broker holds its lock): stop the broker first\n")
        assert files(tmp_path) == before
        code, out, _ = cli("verify", "-d", str(tmp_path))  # reading needs no lock
        assert code == 1 and f"{tmp_path / 'state'} (in use)" in out
    finally:
        holder.close()
        loop.close()


def test_no_state_is_one_line_and_status_2(tmp_path: Path) -> None:
    missing = run_meshmq("state", "verify", "-d", str(tmp_path / "nope"))
    assert (missing.returncode, missing.stdout) == (2, "")
    assert missing.stderr == f"meshmq state: error: {tmp_path / 'nope'}: no such directory\n"
    empty = run_meshmq("state", "repair", "-d", str(tmp_path))
    assert (empty.returncode, empty.stdout) == (2, "")
    assert empty.stderr == (f"meshmq state: error: {tmp_path}: no broker state here (no "
                            f"{tmp_path / 'state'})\n")


def test_the_data_dir_defaults_to_the_one_serve_uses(tmp_path: Path) -> None:
    journal = write_state(tmp_path / "data", [session(1)])
    journal.write_bytes(journal.read_bytes() + b"{torn")
    result = run_meshmq("state", "verify", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "problem: data/state/journal-0.jsonl:2: torn last line" in result.stdout
