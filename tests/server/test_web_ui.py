"""The playground page at ``/`` as the server serves it: content type, cache headers, no
external asset, the settings filled in; ``--disable-web-ui``; the page with an API key.
(The page itself runs in a browser in test_playground_browser.py.)"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from pagedllm.entrypoints.openai.web_ui import display_url, render_page
from tests.server.conftest import started_server

API_KEY = "sk-web-ui"


def page_settings(html: str) -> dict:
    """The settings object the server filled into the page."""
    match = re.search(r"Object\.assign\(\s*\{[^}]*\},\s*(\{.*?\})\);", html, re.S)
    assert match, "the page has no filled-in settings"
    return json.loads(match.group(1))


@pytest.fixture(scope="module")
def keyed_server(server_model_dir, tmp_path_factory):
    with started_server(server_model_dir, tmp_path_factory, "web-ui-keyed",
                        "--api-key", API_KEY) as remote:
        yield remote


def test_root_serves_the_playground_html_with_revalidation(http):
    response = http.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.text.startswith("<!doctype html>")
    assert "<title>pagedllm playground</title>" in response.text
    etag = response.headers["etag"]
    again = http.get("/", headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b""
    assert http.head("/").status_code == 200


def test_the_page_loads_nothing_from_outside(http):
    html = http.get("/").text
    assert re.findall(r"""(?:src|href)\s*=\s*["'](?!data:)[^"']*""", html) == []
    assert re.findall(r"""https?://|["'(]//|@import""", html) == []
    # Its requests go to this server's own paths.
    assert set(re.findall(r"""fetch\(\s*["']([^"']*)""", html)) == {
        "/v1/models", "/v1/chat/completions", "/metrics"}


def test_the_page_knows_the_servers_settings(http, server):
    settings = page_settings(http.get("/").text)
    assert settings == {"api_key_required": False, "metrics": True, "reasoning_parser": None,
                        "tool_call_parser": None, "version": settings["version"]}
    assert "Playground: open http://127.0.0.1:%d/ in a browser" % server.port in server.log()


def test_with_an_api_key_the_page_is_open_and_a_wrong_key_gets_the_servers_error(keyed_server):
    response = httpx.get(keyed_server.base_url + "/")
    assert response.status_code == 200
    settings = page_settings(response.text)
    assert settings["api_key_required"] is True
    assert API_KEY not in response.text
    # What the page shows for a wrong key: the server's own message.
    wrong = httpx.get(keyed_server.api_url + "/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert wrong.json()["error"]["message"] == "Incorrect API key provided."
    assert "error.message" in response.text  # the page reads OpenAI's error shape
    right = httpx.get(keyed_server.api_url + "/models",
                      headers={"Authorization": f"Bearer {API_KEY}"})
    assert right.status_code == 200
    assert httpx.get(keyed_server.base_url + "/metrics").status_code == 200  # charts need no key


def test_disable_web_ui_makes_root_a_404_and_leaves_the_api(server_model_dir, tmp_path_factory):
    with started_server(server_model_dir, tmp_path_factory, "web-ui-off",
                        "--disable-web-ui") as remote:
        response = httpx.get(remote.base_url + "/")
        assert response.status_code == 404
        assert response.json()["error"]["message"] == "Not Found: GET /"
        assert httpx.get(remote.api_url + "/models").json()["data"][0]["id"] == "tiny"
        assert httpx.get(remote.base_url + "/metrics").status_code == 200
        assert "Playground" not in remote.log()


def test_settings_cannot_close_the_script_they_are_written_into():
    html = render_page({"version": "</script><script>alert(1)</script>"}).decode()
    assert "</script><script>alert(1)" not in html
    assert page_settings(html)["version"] == "</script><script>alert(1)</script>"


@pytest.mark.parametrize("host, url", [
    ("0.0.0.0", "http://localhost:8000/"), ("::", "http://localhost:8000/"),
    ("127.0.0.1", "http://127.0.0.1:8000/"), ("::1", "http://[::1]:8000/"),
    ("example.internal", "http://example.internal:8000/"),
])
def test_the_printed_url_is_one_a_browser_opens(host, url):
    assert display_url(host, 8000) == url
