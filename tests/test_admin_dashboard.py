"""The dashboard in a real headless Chromium (Debian's chromium and chromedriver, Selenium),
against a real `wrenmq serve` and real MQTT clients. One browser serves the module.

`make screenshots` runs this module with WRENMQ_SCREENSHOTS=docs: the screenshot test then
runs its load for longer and writes docs/dashboard.png.
"""

import os
import shutil
import subprocess
import threading
import time

import pytest

from admin_helpers import PASSWORDS, AdminBroker, basic
from conftest import ROOT, WRENMQ
from mqtt_helpers import uid, wait_for
from wrenmq.mqtt import constants as C

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    pytest.skip("needs Debian's chromium and chromium-driver (make test installs them)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def admin(tmp_path_factory):
    b = AdminBroker(tmp_path_factory.mktemp("dash"))
    yield b
    b.stop()


@pytest.fixture(scope="module")
def browser(admin):
    opts = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1500,1400", "--force-device-scale-factor=1"):
        opts.add_argument(arg)
    opts.binary_location = CHROMIUM
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    login(driver, "ops")
    driver.get(f"http://127.0.0.1:{admin.admin_port}/")
    yield driver
    driver.quit()


def login(driver, user):
    """HTTP Basic on every request of the page, its fetch calls and its event stream too."""
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.setExtraHTTPHeaders",
                           {"headers": {"Authorization": basic(user, PASSWORDS[user])}})


def until(driver, cond, timeout=10):
    """cond(driver) once truthy; an element the page re-rendered meanwhile (stale) or not
    there yet counts as not yet."""
    return WebDriverWait(driver, timeout, poll_frequency=0.1,
                         ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)
                         ).until(lambda d: cond(d))


def tab(driver, name):
    driver.find_element(By.CSS_SELECTOR, f'#tabs button[data-tab="{name}"]').click()
    until(driver, lambda d: d.find_element(By.ID, f"page-{name}").is_displayed())


def test_the_page_loads_and_goes_live(browser, admin):
    until(browser, lambda d: "on" in d.find_element(By.ID, "live").get_attribute("class"))
    assert browser.find_element(By.ID, "live-text").text == "live"
    node = browser.find_element(By.ID, "node-name").text
    assert node and node != "…"
    assert browser.title == f"wrenmq · {node}"
    assert browser.find_element(By.ID, "who").text == "ops"
    until(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#kpi-connected .value").text != "–")
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_a_connected_client_shows_within_seconds(browser, admin, clients):
    tab(browser, "clients")
    cid = uid("dash")
    c = clients(admin.port, client_id=cid, version=5)
    c.subscribe("dash/seen/#", 1)
    started = time.monotonic()
    row = until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, f'#clients-table tr[data-client-id="{cid}"]'))
    assert time.monotonic() - started < 8
    row[0].click()
    detail = until(browser, lambda d: cid in d.find_element(By.ID, "client-detail").text and
                   d.find_element(By.ID, "client-detail"))
    until(browser, lambda d: "dash/seen/#" in detail.text)
    assert "5.0" in detail.text


def chart_state(driver):
    return driver.execute_script(
        "const p = document.querySelector('#chart-rates path.line.in');"
        "return [p ? p.getAttribute('d') : null, document.querySelector('#kpi-msgs-in .value').textContent];")


def test_charts_move_as_messages_flow(browser, admin, clients):
    tab(browser, "overview")
    until(browser, lambda d: chart_state(d)[0] is not None)
    path_before, _ = chart_state(browser)
    pub = clients(admin.port, client_id=uid("flow"))
    stop = threading.Event()

    def flow():
        while not stop.is_set():
            pub.publish("dash/flow", b"x" * 200, qos=0)
            time.sleep(0.01)

    t = threading.Thread(target=flow, daemon=True)
    t.start()
    try:
        until(browser, lambda d: chart_state(d)[1] not in ("–", "0"), timeout=10)
        path_after, rate = chart_state(browser)
        assert path_after != path_before
        assert float(rate.replace(",", "").rstrip("k")) > 0
        # The next sample moves it again.
        until(browser, lambda d: chart_state(d)[0] != path_after, timeout=5)
    finally:
        stop.set()
        t.join()


def test_the_kick_button_disconnects_the_client(browser, admin, clients):
    cid = uid("kickme")
    c = clients(admin.port, client_id=cid, version=5)
    tab(browser, "clients")
    row = until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, f'#clients-table tr[data-client-id="{cid}"]'))[0]
    button = row.find_element(By.CSS_SELECTOR, "button.kick")
    button.click()
    assert button.text == "Sure?"  # one click arms it, the second kicks
    button.click()
    assert c.disconnected_event.wait(5)
    assert c.disconnect_reason == C.ADMINISTRATIVE_ACTION
    until(browser, lambda d: not d.find_elements(By.CSS_SELECTOR, f'#clients-table tr[data-client-id="{cid}"]'))


def test_a_read_only_user_sees_no_buttons_that_change(browser, admin, clients):
    cid = uid("ro")
    clients(admin.port, client_id=cid)
    login(browser, "viewer")
    try:
        browser.get(f"http://127.0.0.1:{admin.admin_port}/")
        until(browser, lambda d: "read-only" in d.find_element(By.ID, "who").text)
        tab(browser, "clients")
        # (the table is drawn again as figures come: the row is looked up and read in one go)
        kick = until(browser, lambda d: ("shown" if d.find_element(
            By.CSS_SELECTOR, f'#clients-table tr[data-client-id="{cid}"] button.kick').is_displayed() else "hidden"))
        assert kick == "hidden"
        assert not browser.find_element(By.ID, "open-publish").is_displayed()
    finally:
        login(browser, "ops")
        browser.get(f"http://127.0.0.1:{admin.admin_port}/")


def bench(port, seconds, *args):
    return subprocess.Popen([WRENMQ, "bench", "--port", str(port), "--duration", str(seconds), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_screenshot_of_a_broker_under_load(browser, admin, tmp_path, clients):
    """A picture of the dashboard while `wrenmq bench` loads the broker: in the test's
    directory, and in docs/ under `make screenshots`, which lets the load run a minute
    with a burst of fan-out in its middle, and takes the clients page too."""
    out_dir = os.environ.get("WRENMQ_SCREENSHOTS")
    seconds = 70 if out_dir else 8
    keep = [clients(admin.port, client_id=f"sensor-{i:02d}") for i in range(6)]
    for i, c in enumerate(keep):
        c.subscribe(f"site/north/sensor-{i:02d}/cmd", 1)
        c.publish(f"site/north/sensor-{i:02d}/config", f'{{"interval": 5, "unit": "C", "id": {i}}}', 1,
                  retain=True).wait_for_publish(5)
    steady = bench(admin.port, seconds, "--clients", "12", "--interval", "0.04", "--subscribe", "bench/{i}",
                   "--subscribe", "bench/+", "--topics", "6", "--qos", "1", "--size", "180")
    burst = None
    started = time.monotonic()
    try:
        browser.get(f"http://127.0.0.1:{admin.admin_port}/")
        until(browser, lambda d: "on" in d.find_element(By.ID, "live").get_attribute("class"))
        if out_dir:
            time.sleep(20)
            burst = bench(admin.port, 20, "--clients", "8", "--interval", "0.05", "--subscribe", "burst/#",
                          "--prefix", "burst", "--size", "600")
            time.sleep(seconds - 32 - (time.monotonic() - started))
            tab(browser, "clients")
            row = until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#clients-table tr[data-client-id="bench-3"]'))
            row[0].click()
            until(browser, lambda d: "bench/+" in d.find_element(By.ID, "client-detail").text)
            time.sleep(1.0)
            browser.save_screenshot(str(ROOT / out_dir / "dashboard-clients.png"))
            tab(browser, "overview")
            time.sleep(max(0.0, seconds - 4 - (time.monotonic() - started)))
        else:
            wait_for(lambda: steady.poll() is not None, timeout=seconds - 2)
        until(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#kpi-msgs-in .value").text not in ("–", "0"))
        time.sleep(1.5)
        shot = tmp_path / "dashboard.png"
        browser.save_screenshot(str(shot))
        assert shot.stat().st_size > 50_000
        if out_dir:
            (ROOT / out_dir / "dashboard.png").write_bytes(shot.read_bytes())
    finally:
        for p in (steady, burst):
            if p is not None:
                p.wait(seconds + 30)
