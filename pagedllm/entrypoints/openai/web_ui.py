"""The playground at ``GET /``: one HTML page (``static/playground.html``) that talks to this
server's own API.

The page is plain HTML, CSS and JavaScript with no external asset, so it works offline; it
chats through ``/v1/chat/completions`` (streamed), lists models from ``/v1/models`` and
charts the engine from ``/metrics``. The server fills in the settings the page cannot ask
the API for (whether a key is required, the tool-call and reasoning parsers) as a JSON
object in the page; the API key itself never reaches the server's HTML, the browser keeps
it. ``--disable-web-ui`` leaves ``/`` unrouted (404).

The page is served with ``Cache-Control: no-cache`` and an ``ETag``, so a browser
revalidates on every load and an upgraded server's page is never stale.
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import Response

PAGE = "static/playground.html"
# The placeholder in the page that the server's settings replace (a valid JS expression).
_CONFIG_PLACEHOLDER = "/*SERVER_CONFIG*/{}"


def display_url(host: str, port: int, https: bool = False) -> str:
    """The URL a browser on this machine opens: a wildcard host reads as localhost."""
    if host in ("", "0.0.0.0", "::"):
        host = "localhost"
    elif ":" in host:
        host = f"[{host}]"
    return f"{'https' if https else 'http'}://{host}:{port}/"


def render_page(settings: dict) -> bytes:
    """The playground HTML with ``settings`` (JSON-serialisable) filled in."""
    html = resources.files(__package__).joinpath(PAGE).read_text(encoding="utf-8")
    if _CONFIG_PLACEHOLDER not in html:
        raise AssertionError(f"{PAGE} lost its settings placeholder {_CONFIG_PLACEHOLDER!r}")
    # "</" inside a <script> would end it early; "<\/" is the same string to JavaScript.
    blob = json.dumps(settings, sort_keys=True).replace("</", "<\\/")
    return html.replace(_CONFIG_PLACEHOLDER, blob, 1).encode("utf-8")


def add_web_ui(app: FastAPI, settings: dict) -> None:
    """Route ``GET /`` (and ``HEAD /``) to the playground, rendered once."""
    body = render_page(settings)
    etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
    headers = {"Cache-Control": "no-cache", "ETag": etag, "X-Content-Type-Options": "nosniff",
               "Referrer-Policy": "no-referrer"}

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def playground(request: Request):
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers=headers)
        return Response(content=body, media_type="text/html; charset=utf-8", headers=headers)
