"""bench/dashboard_screenshot.py writes outside the checkout unless told otherwise: a trial run
must not overwrite the tracked docs/dashboard.png (refreshing it is ``--out docs/dashboard.png``
on purpose). The screenshot itself needs Chromium and 100 s: tests/node/test_dashboard_browser.py
covers the page."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import dashboard_screenshot  # noqa: E402


def test_the_default_output_is_outside_the_checkout() -> None:
    out = dashboard_screenshot.build_parser().parse_args([]).out.resolve()
    assert out != (ROOT / "docs" / "dashboard.png").resolve()
    assert not out.is_relative_to(ROOT), out


def test_the_tracked_image_is_refreshed_only_when_named() -> None:
    args = dashboard_screenshot.build_parser().parse_args(["--out", "docs/dashboard.png"])
    assert args.out == Path("docs/dashboard.png")
