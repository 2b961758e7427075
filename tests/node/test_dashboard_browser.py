"""The dashboard in a real browser: headless Chromium driven by Selenium, against a broker of 2
workers carrying live traffic. It logs in with the key, checks the figures it shows against the
API, kicks a client from the page (the client gets DISCONNECT 0x98; the row under the pointer
is not redrawn by the page's polling while it is steady), and saves a screenshot in
which the rate chart must have drawn its line; the Services tab shows a service's figures.

Skipped, saying why, without chromium and chromedriver (Debian: ``chromium``,
``chromium-driver``; ``make test`` installs them when it can)."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from admin_http import ADMIN, KEY, get
from pngpixels import read_png

from conftest import WAIT, wait_for

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,1000", "--force-device-scale-factor=1"]
IN_COLOUR = (0x1F, 0x77, 0xB4)  # --in in style.css: the "messages in" line
BROWSER_WAIT = 30.0  # the page polls once a second; a loaded machine may take longer
SCREENSHOT_COPY = os.environ.get("MESHMQ_DASHBOARD_SCREENSHOT")  # also save it there


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[object]:
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("chromium and chromedriver are not installed (Debian packages chromium,"
                    " chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={tmp_path / 'chromium'}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()


class Traffic:
    """A publisher sending QoS 0 and QoS 1 messages until stopped (live traffic)."""

    def __init__(self, publisher) -> None:
        self.publisher = publisher
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        number = 0
        while not self.stopped.wait(0.005):
            number += 1
            self.publisher.publish(f"live/{number % 4}", f"m{number}", qos=number % 2,
                                   wait=False)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(WAIT)


def text(driver, selector: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, selector).text


def figure(driver, selector: str) -> float | None:
    try:
        return float(text(driver, selector).replace(",", ""))
    except ValueError:
        return None


def test_dashboard_in_chromium(broker_factory, client_factory, browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    broker = broker_factory(ADMIN, workers=2)
    subscriber = client_factory("dash-sub")
    subscriber.connect(broker.port)
    subscriber.subscribe("live/#", qos=1)
    publisher = client_factory("dash-pub")
    publisher.connect(broker.port)
    victim = client_factory("dash-victim")
    victim.connect(broker.port)
    traffic = Traffic(publisher)
    try:
        driver.get(f"http://127.0.0.1:{broker.port_of('admin')}/")
        wait_for(lambda: driver.find_element(By.ID, "key").is_displayed(), what="the login")
        driver.find_element(By.ID, "key").send_keys(KEY)
        driver.find_element(By.ID, "login-button").click()

        # live rates, and a chart with a line of several points
        wait_for(lambda: (figure(driver, "#in-rate") or 0) > 0, BROWSER_WAIT, "a message rate")
        wait_for(lambda: len(driver.execute_script(
            "const p = document.getElementById('line-in'); return p ? p.getAttribute('d') : ''"
        ).split("L")) >= 5, BROWSER_WAIT, "five points on the chart")  # one a second

        # the figures shown are the API's (both poll; the counts here are steady)
        def same(selector: str, field: str) -> bool:
            return figure(driver, selector) == get(broker, "/api/v1/overview")[field]

        for selector, field in [("#conn-value", "connections"), ("#sessions-value", "sessions"),
                                ("#subs-value", "subscriptions"), ("#workers-value",
                                                                   "workers_up")]:
            wait_for(lambda s=selector, f=field: same(s, f), what=f"{selector} as the API")
        assert figure(driver, "#conn-value") == 3 and figure(driver, "#workers-value") == 2

        # the screenshot shows the chart's line
        shot = tmp_path / "dashboard.png"
        assert driver.save_screenshot(str(shot))
        chart = driver.find_element(By.ID, "rate-chart")
        rect = chart.rect
        box = (int(rect["x"]), int(rect["y"]), int(rect["x"] + rect["width"]),
               int(rect["y"] + rect["height"]))
        image = read_png(shot)
        assert image.count(IN_COLOUR, box) >= 50, "the rate chart drew no line"
        if SCREENSHOT_COPY:
            shutil.copy(shot, SCREENSHOT_COPY)

        # partitions: the table is the API's
        driver.find_element(By.CSS_SELECTOR, "#tabs [data-tab=partitions]").click()
        api_rows = get(broker, "/api/v1/log/partitions")["data"]
        wait_for(lambda: len(driver.find_elements(
            By.CSS_SELECTOR, "#partitions-table tbody tr")) == len(api_rows),
            what="the partitions table")

        # clients: search, then kick from the page
        driver.find_element(By.CSS_SELECTOR, "#tabs [data-tab=clients]").click()
        driver.find_element(By.ID, "clients-search").send_keys("victim")
        row = "#clients-table tr[data-client-id='dash-victim']"
        wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, row), what="the victim's row")
        wait_for(lambda: len(driver.find_elements(
            By.CSS_SELECTOR, "#clients-table tbody tr")) == 1, what="the search to filter")

        # a steady row stays the same element while the table refreshes around it (a row
        # replaced under the pointer would lose a click): mark it, then wait for a refresh
        # that must show a second client
        driver.execute_script(f"document.querySelector(\"{row}\").meshmqMark = 1")
        late = client_factory("dash-victim-late")
        late.connect(broker.port)
        wait_for(lambda: len(driver.find_elements(
            By.CSS_SELECTOR, "#clients-table tbody tr")) == 2, what="the later client's row")
        assert driver.execute_script(
            f"return document.querySelector(\"{row}\").meshmqMark") == 1, "the row was redrawn"

        driver.find_element(By.CSS_SELECTOR, f"{row} button.kick").click()
        assert victim.disconnects.get(timeout=WAIT).value == 0x98
        wait_for(lambda: not driver.find_elements(By.CSS_SELECTOR, row), what="row gone")
        ids = {r["client_id"] for r in get(broker, "/api/v1/clients")["data"]}
        assert ids == {"dash-sub", "dash-pub", "dash-victim-late"}
    finally:
        traffic.stop()


def test_services_tab_in_chromium(broker_factory, client_factory, browser) -> None:
    """The Services tab shows each service's figures as GET /api/v1/services has them."""
    from paho.mqtt.packettypes import PacketTypes
    from selenium.webdriver.common.by import By

    from conftest import props

    driver = browser
    broker = broker_factory(ADMIN + '[log]\nfsync = "interval"\n', workers=2)
    worker = client_factory("dash-sw")
    worker.connect(broker.port)

    def serve(client, userdata, message) -> None:
        answer = props(PacketTypes.PUBLISH, CorrelationData=message.properties.CorrelationData)
        client.publish(message.properties.ResponseTopic, b"ok", qos=1, properties=answer)

    worker.paho.on_message = serve
    worker.subscribe("$service/dash", qos=1)
    caller = client_factory("dash-caller")
    caller.connect(broker.port)
    caller.subscribe("reply/dash", qos=1)
    for number in range(3):
        caller.publish("$service/dash", b"job", qos=1, properties=props(
            PacketTypes.PUBLISH, ResponseTopic="reply/dash", CorrelationData=bytes([number])))
    for _ in range(3):
        caller.expect()

    driver.get(f"http://127.0.0.1:{broker.port_of('admin')}/")
    wait_for(lambda: driver.find_element(By.ID, "key").is_displayed(), what="the login")
    driver.find_element(By.ID, "key").send_keys(KEY)
    driver.find_element(By.ID, "login-button").click()
    wait_for(lambda: driver.find_element(By.CSS_SELECTOR, "#tabs [data-tab=services]")
             .is_displayed(), BROWSER_WAIT, "the tabs")
    driver.find_element(By.CSS_SELECTOR, "#tabs [data-tab=services]").click()
    row = "#services-table tr[data-service='dash']"
    wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, row), BROWSER_WAIT, "the row")
    api = get(broker, "/api/v1/services")["data"][0]
    cells = [cell.text for cell in driver.find_elements(By.CSS_SELECTOR, f"{row} td")]
    assert cells[:8] == ["dash", "1", "3", "3", "0", "0", "0", "0"], cells
    assert (api["requests"], api["replies"], api["workers"]) == (3, 3, 1)
    assert cells[9].endswith(" ms") and cells[10].endswith(" ms")  # mean and p50
