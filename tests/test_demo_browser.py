"""The demo in a real browser: the Gradio app served on 127.0.0.1, driven by Debian's Chromium through
playwright (``mmspec.demos.browser``; ``bash scripts/setup_browser.sh`` installs the browser).

For every tab: a bad input first (its message must appear in the page, and the app must keep serving),
then a run with real inputs whose speculative result, baseline and statistics must appear (in the video
tab also the animated GIFs of both runs, served with every frame). The tabs load tiny random pipelines
saved to a temp folder, except the AR image tab, which uses the bundled zoo (``mmspec/shapes-t2i``) when
it is built. Screenshots go to a temp folder, or to
``$MMSPEC_DEMO_SCREENSHOTS`` when set. Skipped, with the reason, only where no Chromium can be driven.
"""

from __future__ import annotations

import io
import os
import socket
from pathlib import Path
from urllib.parse import urljoin

import PIL.Image
import pytest

pytest.importorskip("gradio", reason="gradio (the demo extra) is not installed")

from mmspec.demos import browser  # noqa: E402
from mmspec.demos.common import DemoError, resolve_checkpoint  # noqa: E402

REASON = browser.unavailable_reason()
pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(REASON is not None, reason=f"no browser to drive: {REASON}")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("MMSPEC_DEMO_SCREENSHOTS") or tmp_path_factory.mktemp("demo-screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from mmspec.demos.app import launch
    from mmspec.demos.tiny import build_tiny_pipelines

    paths = build_tiny_pipelines(tmp_path_factory.mktemp("demo-tiny"), ("vlm", "continuous", "video"))
    try:
        resolve_checkpoint("ar_image", "mmspec/shapes-t2i")
        paths["ar_image"] = "mmspec/shapes-t2i"
    except DemoError:  # the zoo entry is not built: a tiny random one instead
        paths.update(build_tiny_pipelines(tmp_path_factory.mktemp("demo-tiny-ar"), ("ar_image",)))
    app, url = launch(paths, host="127.0.0.1", port=_free_port(), block=False, quiet=True)
    yield url, paths
    app.close()


@pytest.fixture(scope="module")
def page(server):
    url, _ = server
    with browser.open_browser() as page:
        page.set_default_timeout(60_000)
        page.goto(url)
        page.wait_for_selector("#vlm-message .mmspec-message")  # the page loaded and checked the checkpoints
        yield page


def test_served_on_localhost_and_checkpoints_reported(server, page, shots):
    url, paths = server
    assert url.startswith("http://127.0.0.1:")
    assert paths["vlm"] in page.inner_text("#vlm-message")  # the tab says which checkpoint it will load
    page.screenshot(path=str(shots / "start.png"), full_page=True)


def test_vlm_tab(page, shots):
    elem = browser.open_tab(page, "vlm")
    page.get_by_label("(none: use my upload)").check()  # no upload and no example: nothing to look at
    kind, message = browser.run_and_wait(page, elem)
    assert kind == "error" and "no image" in message
    page.screenshot(path=str(shots / "vlm-error.png"), full_page=True)

    page.get_by_label("shapes clip 0 (video, 4 frames)").check()
    page.wait_for_function("() => document.querySelector('#vlm-prompt textarea').value === 'narrate the video.'")
    browser.set_field(page, "vlm-max-new-tokens", 30)
    kind, message = browser.run_and_wait(page, elem)
    assert kind == "ok", message
    answer = page.inner_text("#vlm-answer")
    assert len(answer.split()) > 5  # the streamed speculative answer
    assert page.locator("#vlm-baseline textarea").input_value().strip()  # the baseline answer
    stats = page.inner_text("#vlm-stats")
    for text in ("speedup", "mean accepted length", "target calls", "wall time", "same text as the baseline"):
        assert text in stats
    assert page.locator("#vlm-preview img").count() == 4  # the clip's frames
    page.screenshot(path=str(shots / "vlm.png"), full_page=True)


def _image_tab(page, shots, family: str, bad_field: str, bad_value, expected: str, method_label: str) -> None:
    elem = browser.open_tab(page, family)
    path_field = f"{elem}-path"
    good_path = page.locator(f"#{path_field} input, #{path_field} textarea").first.input_value()
    browser.set_field(page, bad_field, bad_value)
    kind, message = browser.run_and_wait(page, elem)
    assert kind == "error" and expected in message, message
    page.screenshot(path=str(shots / f"{family}-error.png"), full_page=True)
    if bad_field == path_field:
        browser.set_field(page, path_field, good_path)
    else:  # back to the default
        browser.set_field(page, bad_field, 4)
    kind, message = browser.run_and_wait(page, elem)
    assert kind == "ok", message
    page.wait_for_selector(f"#{elem}-gallery img")
    page.wait_for_selector(f"#{elem}-baseline img")
    stats = page.inner_text(f"#{elem}-stats")
    for text in ("speedup", "mean accepted length", "target calls", "wall time", f"speculative ({method_label})"):
        assert text in stats
    page.screenshot(path=str(shots / f"{family}.png"), full_page=True)


def test_ar_image_tab(page, shots):
    _image_tab(page, shots, "ar_image", "ar-image-path", "/no/such/checkpoint", "does not exist", "eagle")


def test_continuous_tab(page, shots):
    _image_tab(page, shots, "continuous", "continuous-gamma", 0, "CSpD gamma", "cspd")


def test_video_tab(server, page, shots):
    elem = browser.open_tab(page, "video")
    browser.set_field(page, "video-path", "mmspec/no-such-entry")
    kind, message = browser.run_and_wait(page, elem)
    assert kind == "error" and "unknown zoo id 'mmspec/no-such-entry'" in message
    page.screenshot(path=str(shots / "video-error.png"), full_page=True)

    browser.set_field(page, "video-path", server[1]["video"])
    browser.set_field(page, "video-tau", 0)
    kind, message = browser.run_and_wait(page, elem)
    assert kind == "ok", message
    page.wait_for_selector("#video-strip img")
    page.wait_for_selector("#video-baseline img")
    for animation in ("#video-animation img", "#video-baseline-animation img"):  # both runs, animated
        image = page.wait_for_selector(animation)
        page.wait_for_function("(img) => img.complete && img.naturalWidth > 0", arg=image)
        source = image.get_attribute("src")
        assert source.split("?")[0].endswith(".gif"), source
        served = page.request.get(urljoin(page.url, source))  # the file the page plays: every frame of the video
        assert served.ok, served.status
        with PIL.Image.open(io.BytesIO(served.body())) as gif:
            assert gif.format == "GIF" and gif.is_animated and gif.n_frames == 8  # the tiny video's 8 frames
        shots_of_image = set()  # and the browser plays it: the picture changes (frames are 250 ms apart)
        for _ in range(20):
            shots_of_image.add(image.screenshot())
            if len(shots_of_image) > 1:
                break
            page.wait_for_timeout(100)
        assert len(shots_of_image) > 1, "the GIF does not play"
    blocks = page.inner_text("#video-block-strip")
    assert "block 0" in blocks and "reward" in blocks and "tau = 0" in blocks
    stats = page.inner_text("#video-stats")
    for text in ("speedup", "target calls", "wall time", "blocks from the drafter", "speculative (sdvg)"):
        assert text in stats
    page.screenshot(path=str(shots / "video.png"), full_page=True)

