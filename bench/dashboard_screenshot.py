"""A screenshot of the dashboard of a 2-worker node under live traffic, in headless Chromium
(the packages and Python extras of ``make test``): the image in docs/operations.md.

The load: 12 publishers on ``live/<n>`` whose combined rate rises and falls over two minutes,
one subscriber of ``live/#`` and one of ``live/0``, so that messages out exceed messages in;
clients connect in steps, so the connections chart moves too. Usage::

    .venv/bin/python bench/dashboard_screenshot.py [--seconds 100] [--out PATH]

The image goes to ``meshmq-dashboard.png`` in the temporary directory unless ``--out`` names
another path, so that a trial run never overwrites the tracked ``docs/dashboard.png``. To
refresh that one on purpose, give ``--out docs/dashboard.png`` and commit the new image.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
from meshbench.brokers import RunningBroker, free_port, start_meshmq

KEY = "dashboard-key"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-dev-shm-usage", "--window-size=1400,720", "--force-device-scale-factor=1"]


def start_node(workdir: Path) -> tuple[RunningBroker, int]:
    """A node of 2 workers with the admin listener on a free port: (node, admin port)."""
    admin = free_port()
    node = start_meshmq(workdir, {"server.workers": 2, "admin.listen": f"127.0.0.1:{admin}",
                                  "admin.api_key": KEY}, None)
    return node, admin


def client(port: int, name: str) -> mqtt.Client:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=name,
                    protocol=mqtt.MQTTv5)
    c.connect("127.0.0.1", port)
    c.loop_start()
    return c


def publish_wave(port: int, seconds: float, stop: threading.Event) -> None:
    """Publishers joining in steps; together 100 to 600 messages/s, one period per run."""
    publishers: list[mqtt.Client] = []
    started = time.monotonic()
    sent = 0
    while not stop.is_set():
        elapsed = time.monotonic() - started
        if len(publishers) < 12 and elapsed > len(publishers) * 4:
            publishers.append(client(port, f"sensor-{len(publishers)}"))
        rate = 350 + 250 * math.sin(2 * math.pi * elapsed / seconds)
        due = int(rate * 0.05)
        for _ in range(due):
            sent += 1
            publishers[sent % len(publishers)].publish(f"live/{sent % 4}", b"x" * 32,
                                                       qos=sent % 2)
        time.sleep(0.05)
    for publisher in publishers:
        publisher.disconnect()


DEFAULT_OUT = Path(tempfile.gettempdir()) / "meshmq-dashboard.png"  # outside the checkout


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=100.0,
                        help="seconds of traffic before the screenshot (default 100)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"where the PNG goes (default {DEFAULT_OUT}); docs/dashboard.png"
                        " refreshes the image of docs/operations.md")
    return parser


def main() -> int:
    args = build_parser().parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        raise SystemExit("chromium and chromedriver are needed (Debian: chromium, "
                         "chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    with tempfile.TemporaryDirectory() as tmp:
        node, admin = start_node(Path(tmp))
        port = node.port
        stop = threading.Event()
        subscribers = [client(port, "dashboard-all"), client(port, "dashboard-zero")]
        subscribers[0].subscribe("live/#", qos=1)
        subscribers[1].subscribe("live/0", qos=1)
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for flag in [*FLAGS, f"--user-data-dir={Path(tmp) / 'chromium'}"]:
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service(executable_path=driver_path),
                                  options=options)
        load = threading.Thread(target=publish_wave, args=(port, args.seconds, stop))
        try:
            driver.get(f"http://127.0.0.1:{admin}/")
            time.sleep(1)
            driver.find_element(By.ID, "key").send_keys(KEY)
            driver.find_element(By.ID, "login-button").click()
            load.start()
            time.sleep(args.seconds)
            driver.save_screenshot(str(args.out))
        finally:
            stop.set()
            if load.is_alive():
                load.join()
            driver.quit()
            for c in subscribers:
                c.disconnect()
            node.stop()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
