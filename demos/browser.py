"""A headless browser for the demo's browser test and screenshots: Debian's ``chromium`` driven by the
python ``playwright`` client (playwright's own browser download is not used: the project's machines reach
only package registries). ``bash scripts/setup_browser.sh`` installs the browser."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-dev-shm-usage"]


def find_chromium() -> str | None:
    """The browser binary: ``$MMSPEC_CHROMIUM``, Debian's ``/usr/bin/chromium``, or ``chromium`` on PATH."""
    configured = os.environ.get("MMSPEC_CHROMIUM")
    for candidate in ([configured] if configured else []) + list(CANDIDATES):
        if Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


def unavailable_reason() -> str | None:
    """Why no browser can be driven here (None when one can)."""
    if importlib.util.find_spec("playwright") is None:
        return "the playwright python package is missing (pip install \"mmspec[demo]\")"
    if find_chromium() is None:
        return ("no chromium binary (looked at $MMSPEC_CHROMIUM, /usr/bin/chromium, PATH): run "
                "bash scripts/setup_browser.sh (apt-get install -y chromium)")
    return None


@contextlib.contextmanager
def open_browser(width: int = 1400, height: int = 1000) -> Iterator[Any]:
    """A playwright page in headless Chromium (closed afterwards)."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=find_chromium(), args=ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            yield page
        finally:
            browser.close()


# ----------------------------------------------------------------------------------------------------
# driving the demo page (shared by tests/test_demo_browser.py and mmspec.demos.screenshot)
# ----------------------------------------------------------------------------------------------------

#: family -> the prefix of its tab's element ids
ELEMENTS = {"vlm": "vlm", "ar_image": "ar-image", "continuous": "continuous", "video": "video"}


def open_tab(page: Any, family: str) -> str:
    """Select the tab of ``family``; returns its element-id prefix."""
    elem = ELEMENTS[family]
    page.click(f"#tab-{elem}-button")
    page.wait_for_selector(f"#{elem}-run", state="visible")
    return elem


def set_field(page: Any, elem_id: str, value: Any, attempts: int = 10) -> None:
    """Type ``value`` into the text or number input of the component ``elem_id`` (then leave the field, so
    the page registers it). On a loaded machine the page may still be rendering the tab and replace the
    input after the first fill, so the value is checked a moment later and typed again until it holds."""
    text, selector = str(value), f"#{elem_id} input, #{elem_id} textarea"
    for _ in range(attempts):
        field = page.locator(selector).first
        field.fill(text)
        field.press("Tab")
        page.wait_for_timeout(300)
        if page.locator(selector).first.input_value() == text:  # looked up again: the input may be new
            return
    raise AssertionError(f"the page did not keep {text!r} in #{elem_id}")


def run_and_wait(page: Any, elem: str, timeout_s: float = 120.0) -> tuple[str, str]:
    """Click the tab's Run button and wait for its outcome: ``("ok" | "warn" | "error", message text)``
    ("warn": a result whose timing is not trusted).

    The outcome is the first final message (ok, warn or error) shown after the click; progress messages in
    between are skipped. The previous message is blanked in the page before the click (the run replaces it
    with "starting..." first, so even a result worded exactly as the previous one is seen as new).
    """
    selector = f"#{elem}-message .mmspec-message"
    page.evaluate("(selector) => { const box = document.querySelector(selector); if (box) box.innerText = ''; }",
                  selector)
    before = ""
    page.click(f"#{elem}-run")
    page.wait_for_function(
        """([selector, previous]) => {
            const box = document.querySelector(selector);
            if (!box || box.innerText === previous) return false;
            return ['ok', 'warn', 'error'].some((kind) => box.classList.contains('mmspec-message-' + kind));
        }""", arg=[selector, before], timeout=timeout_s * 1000)
    box = page.locator(selector).first
    classes = box.get_attribute("class") or ""
    kind = next(kind for kind in ("ok", "warn", "error") if f"mmspec-message-{kind}" in classes)
    return kind, box.inner_text().strip()
