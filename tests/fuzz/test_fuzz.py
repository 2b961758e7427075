"""Fuzzing the decoder and the per-connection state machine (harness: ``mqttfuzz.py``).

* ``test_regression_corpus``: every case in ``corpus/`` (each a crash or hang the fuzzer or a
  hostile test once found, with a note saying what it was) still passes.
* ``test_mutation_fuzzer``: fresh generated-and-mutated cases for a bounded time, 25 s by
  default; ``MESHMQ_FUZZ_SECONDS=3600`` for a long run, ``MESHMQ_FUZZ_SEED=N`` to repeat one.
  The seed is random per run and printed on failure along with a shrunk case to add to the
  corpus.
* Hypothesis properties: random bytes after a valid CONNECT, split anywhere, and random
  generator seeds (shrunk and remembered by Hypothesis when they fail).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mqttfuzz import CORPUS, Case, check_case, generate_case, run_fuzzer

from meshmq.mqtt.codec import encode_packet
from meshmq.mqtt.packets import Connect

FUZZ_SECONDS = float(os.environ.get("MESHMQ_FUZZ_SECONDS", "25"))
FUZZ_SEED = int(os.environ.get("MESHMQ_FUZZ_SEED", random.SystemRandom().randrange(2**32)))
LONG = FUZZ_SECONDS > 60


@pytest.mark.parametrize("path", sorted(CORPUS.glob("*.json")), ids=lambda p: p.stem)
def test_regression_corpus(path: Path) -> None:
    check_case(Case.from_json(path.read_text()))


def test_the_corpus_is_not_empty() -> None:
    assert len(list(CORPUS.glob("*.json"))) >= 5


@pytest.mark.slow
@pytest.mark.timeout(FUZZ_SECONDS + 120)
def test_mutation_fuzzer(tmp_path: Path) -> None:
    """No crash, hang or broken invariant in ``FUZZ_SECONDS`` of fresh cases."""
    count = run_fuzzer(FUZZ_SECONDS, FUZZ_SEED, tmp_path / "crashes")
    print(f"fuzzed {count} cases in {FUZZ_SECONDS:g} s, seed {FUZZ_SEED}")
    assert count > 100, "the fuzzer barely ran"


@settings(max_examples=3000 if LONG else 300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([4, 5]), st.binary(max_size=300),
       st.lists(st.integers(1, 400), max_size=6), st.integers(0, 3))
def test_random_bytes_after_connect(version, tail, cuts, max_events) -> None:
    data = encode_packet(Connect("fuzz", version), version) + tail
    check_case(Case(version, data, sorted(set(cuts)), driver_seed=len(tail),
                    max_events=max_events))


@settings(max_examples=3000 if LONG else 300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_generated_cases(seed: int) -> None:
    check_case(generate_case(random.Random(seed)))
