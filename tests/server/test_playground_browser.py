"""The playground in a real headless Chromium (Selenium), against ``pagedllm serve`` with the
bundled demo model (as ``make serve`` runs it) and an API key.

One server and one browser are shared by the module; the tests run in order on the same
page. Skips with the reason when Selenium, chromium or chromedriver is missing (Debian:
``apt-get install chromium chromium-driver``). The console must stay free of errors
(SEVERE entries); where a test provokes an HTTP error on purpose, the only SEVERE entry
allowed is the browser's note of that failed request.

``PAGEDLLM_UPDATE_SCREENSHOT=1`` also writes the last screenshot to docs/playground.png.
"""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest

from tests.server.conftest import REPO_ROOT, RemoteServer

webdriver = pytest.importorskip(
    "selenium.webdriver", reason="selenium is not installed: pip install -e '.[test]'")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

API_KEY = "sk-playground-test"
MODEL = "pagedllm-demo"
WAIT_S = 90
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))),
                None)
CHROMEDRIVER = shutil.which("chromedriver")
CHROMIUM_FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--no-first-run", "--disable-extensions", "--disable-default-apps",
    "--window-size=1440,900", "--force-device-scale-factor=1",
)


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    remote = RemoteServer(None, tmp_path_factory.mktemp("playground-server") / "server.log",
                          "--api-key", API_KEY)
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("chromium and chromedriver are not installed (Debian: apt-get install "
                    "chromium chromium-driver): the browser test needs both")
    folder = tmp_path_factory.mktemp("chromium")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={folder / 'profile'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=CHROMEDRIVER, log_output=str(folder / "chromedriver.log"))
    browser = webdriver.Chrome(options=options, service=service)
    browser.set_page_load_timeout(60)
    yield browser
    browser.quit()


@pytest.fixture
def page(driver, demo_server):
    """The playground loaded afresh and connected with the right key: the tab keeps the
    key once given, else it is entered here, so each test runs alone as well as after
    the others."""
    page = driver
    page.get(demo_server.base_url + "/")
    wait(page, lambda: text(page, "#conn").startswith("connected")
         or "needs an API key" in text(page, "#banner"))
    if not text(page, "#conn").startswith("connected"):
        set_value(page, "api-key", API_KEY)
        page.find_element(By.ID, "use-key").click()
        wait(page, lambda: text(page, "#conn").startswith("connected"))
    severe_entries(page)  # what loading logged is not the test's
    return page


def wait(driver, predicate, timeout: float = WAIT_S):
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: predicate())


def text(driver, css: str) -> str:
    found = driver.find_elements(By.CSS_SELECTOR, css)
    return found[-1].text if found else ""


def severe_entries(driver) -> list[str]:
    """SEVERE console entries since the last call (reading the log empties it)."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def assert_only_failed_request(driver, status: int) -> None:
    """The console holds nothing worse than the browser's note of a request answered
    ``status`` (a page that shows the server's error, as it should)."""
    unexpected = [m for m in severe_entries(driver)
                  if f"the server responded with a status of {status}" not in m]
    assert unexpected == []


def set_value(driver, element_id: str, value: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def open_group(driver, element_id: str) -> None:
    group = driver.find_element(By.ID, element_id)
    if group.get_attribute("open") is None:
        group.find_element(By.TAG_NAME, "summary").click()


def send(driver, message: str) -> None:
    driver.find_element(By.ID, "clear").click()
    set_value(driver, "prompt", message)
    driver.find_element(By.ID, "send").click()


def wait_for_reply(driver):
    """The last assistant message once its stream has ended (its meta line is shown)."""
    wait(driver, lambda: driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta")
         or driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .error-text"))
    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


def screenshot(driver, tmp_path, name: str) -> None:
    """Saved once the engine panel has seen the request end (nothing left running)."""
    wait(driver, lambda: text(driver, "#stat-requests").startswith("0 running"))
    path = tmp_path / name
    assert driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000
    if os.environ.get("PAGEDLLM_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(path, REPO_ROOT / "docs" / "playground.png")


def test_wrong_key_shows_the_servers_error_and_the_right_key_connects(driver, demo_server):
    page = driver
    page.get(demo_server.base_url + "/")
    page.execute_script("sessionStorage.clear()")  # a tab that was never given the key
    page.get(demo_server.base_url + "/")
    wait(page, lambda: "needs an API key" in text(page, "#banner"))
    set_value(page, "api-key", "wrong-key")
    page.find_element(By.ID, "use-key").click()
    wait(page, lambda: "Incorrect API key provided." in text(page, "#banner"))
    assert "401" in text(page, "#banner")
    assert_only_failed_request(page, 401)

    set_value(page, "api-key", API_KEY)
    page.find_element(By.ID, "use-key").click()
    wait(page, lambda: text(page, "#conn").startswith("connected"))
    assert not page.find_element(By.ID, "banner").is_displayed()
    assert Select(page.find_element(By.ID, "model")).first_selected_option.text == MODEL
    # The key lives in the browser (this tab's sessionStorage), not in the page's HTML.
    assert page.execute_script("return sessionStorage.getItem('pagedllm.apiKey')") == API_KEY
    assert severe_entries(page) == []


def test_a_message_streams_its_reply_and_the_engine_panel_counts_it(page, demo_server, tmp_path):
    Select(page.find_element(By.ID, "window")).select_by_value("60")
    assert text(page, "#bucket-label") == "per 1 s"
    set_value(page, "temperature", "0")
    set_value(page, "max-tokens", "48")
    prompt = "Write a function that reverses a list."
    send(page, prompt)
    reply = wait_for_reply(page)
    content = reply.find_element(By.CSS_SELECTOR, ".content").text
    assert content.strip()
    assert int(reply.get_attribute("data-chunks")) > 1  # streamed, chunk by chunk
    assert "finish_reason:" in reply.find_element(By.CSS_SELECTOR, ".meta").text

    # Greedy: the page shows what the API answers to the same conversation.
    expected = httpx.post(
        f"{demo_server.api_url}/chat/completions", timeout=60,
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": MODEL, "messages": [{"role": "user", "content": prompt}],
              "temperature": 0, "max_tokens": 48},
    ).json()["choices"][0]["message"]["content"]
    assert content.strip() == expected.strip()

    wait(page, lambda: int(text(page, "#stat-completed").split()[0] or 0) >= 1)
    wait(page, lambda: "generated" in text(page, "#stat-tps")
         and int(text(page, "#stat-tps").split("·")[1].split()[0]) >= 1)
    assert "%" in text(page, "#stat-kv") and "running" in text(page, "#stat-requests")
    wait(page, lambda: page.execute_script("return samples.length") >= 2)  # the charts have points
    screenshot(page, tmp_path, "playground-chat.png")
    assert severe_entries(page) == []


def enable_tools(driver) -> None:
    """The tools group open and its example tool on."""
    open_group(driver, "tools-group")
    tools_enabled = driver.find_element(By.ID, "tools-enabled")
    if not tools_enabled.is_selected():
        tools_enabled.click()


def test_a_required_tool_call_is_shown_as_the_api_returns_it(page, tmp_path):
    enable_tools(page)
    Select(page.find_element(By.ID, "tool-choice")).select_by_value("required")
    set_value(page, "max-tokens", "100")
    send(page, "What is the weather in Paris?")
    reply = wait_for_reply(page)
    call = reply.find_element(By.CSS_SELECTOR, ".toolcall")
    head = call.find_element(By.CSS_SELECTOR, ".head")
    assert head.find_element(By.TAG_NAME, "b").text == "get_weather"
    assert head.find_element(By.CSS_SELECTOR, ".id").text  # the call's id
    arguments = json.loads(call.find_element(By.TAG_NAME, "pre").text)
    assert isinstance(arguments["city"], str)
    assert "finish_reason: tool_calls" in reply.find_element(By.CSS_SELECTOR, ".meta").text
    sent = page.execute_script("return document.getElementById('last-request').textContent")
    body = json.loads(sent.split("\n", 1)[1])
    assert body["tool_choice"] == "required"
    assert [tool["function"]["name"] for tool in body["tools"]] == ["get_weather"]
    screenshot(page, tmp_path, "playground-tool-call.png")
    assert severe_entries(page) == []


def test_auto_tool_choice_without_the_parser_shows_the_servers_400(page):
    enable_tools(page)
    assert "--enable-auto-tool-choice" in text(page, "#auto-note")
    Select(page.find_element(By.ID, "tool-choice")).select_by_value("auto")
    send(page, "What is the weather in Paris?")
    reply = wait_for_reply(page)
    error = reply.find_element(By.CSS_SELECTOR, ".error-text").text
    assert error.startswith("400")
    assert "needs the server to run with --enable-auto-tool-choice" in error
    assert_only_failed_request(page, 400)


def test_a_json_schema_constrains_the_reply(page):
    open_group(page, "structured-group")
    Select(page.find_element(By.ID, "structured-mode")).select_by_value("json_schema")
    set_value(page, "max-tokens", "100")
    send(page, "Describe a user.")
    reply = wait_for_reply(page)
    user = json.loads(reply.find_element(By.CSS_SELECTOR, ".content").text)
    assert set(user) == {"name", "age"} and 0 <= user["age"] <= 120
    assert severe_entries(page) == []


def test_reasoning_is_shown_apart_from_the_answer(driver, tmp_path_factory):
    """With --reasoning-parser deepseek_r1 an output with no ``</think>`` is all reasoning:
    the page shows it in its own block, and no answer text."""
    remote = RemoteServer(None, tmp_path_factory.mktemp("playground-reasoning") / "server.log",
                          "--reasoning-parser", "deepseek_r1")
    try:
        driver.get(remote.base_url + "/")
        wait(driver, lambda: text(driver, "#conn").startswith("connected"))
        assert "deepseek_r1" in driver.execute_script(
            "return document.getElementById('reasoning-note').textContent")
        set_value(driver, "temperature", "0")
        set_value(driver, "max-tokens", "24")
        send(driver, "Write a function that reverses a list.")
        reply = wait_for_reply(driver)
        reasoning = reply.find_element(By.CSS_SELECTOR, ".reasoning .text").text
        expected = httpx.post(
            f"{remote.api_url}/chat/completions", timeout=60,
            json={"messages": [{"role": "user", "content": "Write a function that reverses a list."}],
                  "temperature": 0, "max_tokens": 24},
        ).json()["choices"][0]["message"]
        assert expected["content"] is None
        assert reasoning.strip() == expected["reasoning_content"].strip() != ""
        assert reply.find_elements(By.CSS_SELECTOR, ".content") == []
        assert severe_entries(driver) == []
    finally:
        remote.stop()
