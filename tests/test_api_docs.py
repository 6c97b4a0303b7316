"""/api/docs works without the internet: Swagger UI comes from the console's own static
files, and the page asks nothing of any other host."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from urllib.parse import urlsplit

import pytest
from django.test import Client
from playwright.sync_api import expect

from reachconsole.api import api
from tests.browser import chromium_page
from tests.conftest import TOKEN, register


class _References(HTMLParser):
    """Every URL a page makes the browser load: src and href attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("src", "href") and value:
                self.urls.append(value)


def _operations() -> int:
    schema = api.get_openapi_schema()
    return sum(len(methods) for methods in schema["paths"].values())


def test_the_docs_page_loads_only_local_assets():
    client = Client()
    page = client.get("/api/docs")
    assert page.status_code == 200
    html = page.content.decode()
    found = _References()
    found.feed(html)
    assert any(url.endswith("swagger-ui-bundle.js") for url in found.urls), found.urls
    for url in found.urls:
        parts = urlsplit(url)
        assert not parts.scheme and not parts.netloc, f"{url} is not served by the console"
        asset = client.get(url)
        assert asset.status_code == 200, url
        body = b"".join(asset.streaming_content) if asset.streaming else asset.content
        assert body, url
    settings_json = re.search(r'id="swagger-settings">(.*?)</script>', html, re.S).group(1)
    swagger = json.loads(settings_json)
    assert swagger["validatorUrl"] is None  # the default sends the document to the internet
    document = client.get(swagger["url"])
    assert document.status_code == 200
    json.loads(document.content, object_pairs_hook=_no_repeated_keys)


def _no_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    # Swagger UI reads the document as YAML, where a repeated key is an error that leaves
    # the page empty (Python's json keeps the last one silently).
    keys = [key for key, _ in pairs]
    assert len(keys) == len(set(keys)), f"repeated keys in the OpenAPI document: {keys}"
    return dict(pairs)


@pytest.mark.django_db(transaction=True)
def test_swagger_ui_renders_every_operation_offline(live_server, async_unsafe):
    blocked: list[str] = []
    local = urlsplit(live_server.url).netloc

    def only_local(route):
        if urlsplit(route.request.url).netloc == local:
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    with chromium_page() as page:
        page.route("**/*", only_local)
        page.goto(f"{live_server.url}/api/docs")
        expect(page.locator(".opblock")).to_have_count(_operations())
        expect(page.locator(".info .title")).to_contain_text("reachconsole")
        assert page.locator(".opblock-summary-path", has_text="/api/roster/agents").count() >= 1
    assert blocked == []


def test_the_document_asks_for_the_source_header_with_the_token():
    schema = api.get_openapi_schema()
    scheme = schema["components"]["securitySchemes"]["SourceHeader"]
    assert (scheme["type"], scheme["in"], scheme["name"]) == ("apiKey", "header",
                                                              "X-OODER-Source")
    assert "docs/protocol.md" in schema["info"]["description"]
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            if operation.get("security"):  # /healthz and the like need none
                assert operation["security"] == [{"ServiceAuth": [], "SourceHeader": []}], (
                    method, path)


@pytest.mark.django_db(transaction=True)
def test_try_it_out_answers_once_authorized_with_token_and_source(live_server, async_unsafe):
    register("docs.agent", "node-docs")
    with chromium_page() as page:
        page.goto(f"{live_server.url}/api/docs")
        page.locator(".btn.authorize").first.click()
        dialog = page.locator(".dialog-ux")
        token = dialog.locator(".auth-container", has_text="ServiceAuth")
        token.locator("input").fill(TOKEN)
        token.locator("button.authorize").click()
        source = dialog.locator(".auth-container", has_text="SourceHeader")
        source.locator("input").fill("studio")
        source.locator("button.authorize").click()
        dialog.locator("button.btn-done").first.click()
        operation = page.locator(".opblock-get", has=page.locator(
            ".opblock-summary-path", has_text=re.compile(r"^/api/roster/agents$")))
        operation.locator(".opblock-summary").first.click()
        operation.locator(".try-out__btn").click()
        operation.locator(".execute").click()
        expect(operation.locator(".live-responses-table tbody .response-col_status").first
               ).to_have_text("200")
        expect(operation.locator(".live-responses-table .microlight").first
               ).to_contain_text("docs.agent")
