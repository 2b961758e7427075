"""Make docs/dashboard.png: the dashboard of a 2-worker node under live traffic, in headless
Chromium (the packages and Python extras of ``make test``).

The load: 12 publishers on ``live/<n>`` whose combined rate rises and falls over two minutes,
one subscriber of ``live/#`` and one of ``live/0``, so that messages out exceed messages in;
clients connect in steps, so the connections chart moves too. Usage::

    .venv/bin/python bench/dashboard_screenshot.py [--seconds 100] [--out docs/dashboard.png]
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt

KEY = "dashboard-key"
CONFIG = f"""
[admin]
listen = "127.0.0.1:0"
api_key = "{KEY}"
"""
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-dev-shm-usage", "--window-size=1400,720", "--force-device-scale-factor=1"]


def start_node(workdir: Path) -> tuple[subprocess.Popen, int, int]:
    (workdir / "meshmq.toml").write_text(CONFIG)
    port_file = workdir / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshmq", "serve", "--config", str(workdir / "meshmq.toml"),
         "--port", "0", "--data-dir", str(workdir / "data"), "--workers", "2",
         "--port-file", str(port_file)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the broker did not start")
        time.sleep(0.1)
    first, *named = port_file.read_text().split()
    ports = dict(line.split("=") for line in named)
    return proc, int(first), int(ports["admin"])


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=100.0)
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        raise SystemExit("chromium and chromedriver are needed (Debian: chromium, "
                         "chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    with tempfile.TemporaryDirectory() as tmp:
        proc, port, admin = start_node(Path(tmp))
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
            proc.terminate()
            proc.wait(30)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
