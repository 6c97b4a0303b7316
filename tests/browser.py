"""Debian's Chromium driven by Playwright: the one browser set-up every browser test shares."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

CHROMIUM = os.environ.get("REACH_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def chromium_or_skip() -> str:
    """CI installs Chromium and sets REACH_REQUIRE_BROWSER=1, which turns a skip into a failure."""
    if shutil.which(CHROMIUM) or os.path.exists(CHROMIUM):
        return CHROMIUM
    if os.environ.get("REACH_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium")
    pytest.skip(f"{CHROMIUM} is not installed (apt-get install -y chromium)")


@contextmanager
def chromium_page(**context) -> Iterator:
    """A page of a fresh browser; `context`: Playwright's context options (timezone_id…)."""
    from playwright.sync_api import sync_playwright

    executable = chromium_or_skip()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(**context)
            page.set_default_timeout(15000)
            yield page
        finally:
            browser.close()


def sign_in(page, base: str, username: str, password: str, next_path: str = "/") -> None:
    """Sign in through the login form, then land on `next_path`."""
    page.goto(f"{base}/accounts/login/?next={next_path}")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")
    page.wait_for_url(lambda url: "/accounts/login/" not in url)
    htmx_ready(page)


def htmx_ready(page) -> None:
    """Wait for the page a click navigated to (once it is there) to finish loading: htmx, a
    deferred script, wires the page's triggers only then, and a change made before is lost."""
    page.wait_for_load_state("load")
    page.wait_for_function("() => window.htmx !== undefined")
