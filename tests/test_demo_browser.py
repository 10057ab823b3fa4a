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
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread"),
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
    with browser.open_browser(*VIEWPORT) as page:
        page.set_default_timeout(60_000)
        page.goto(url)
        page.wait_for_selector("#vlm-message .mmspec-message")  # the page loaded and checked the checkpoints
        yield page


VIEWPORT = (1400, 1000)


def _screenshot(page, shots: Path, name: str, elem: str) -> None:
    """The tab as a visitor sees it at 1400x1000 (no scrolling): Run and the result card must be in view."""
    page.evaluate("window.scrollTo(0, 0)")
    for selector in (f"#{elem}-run", f"#{elem}-card"):
        box = page.locator(selector).bounding_box()
        assert box is not None and box["y"] + min(box["height"], 40) <= VIEWPORT[1], (selector, box)
    page.screenshot(path=str(shots / name))


def _open_advanced(page, elem: str) -> None:
    if not page.locator(f"#{elem}-path").is_visible():
        page.click(f"#{elem}-advanced button, #{elem}-advanced .label-wrap")
        page.wait_for_selector(f"#{elem}-path", state="visible")


def test_served_on_localhost_and_checkpoints_reported(server, page, shots):
    url, paths = server
    assert url.startswith("http://127.0.0.1:")
    assert paths["vlm"] in page.inner_text("#vlm-message")  # the tab says which checkpoint it will load
    assert "know only the synthetic shapes world" in page.inner_text("body")
    assert not page.locator("#vlm-path").is_visible()  # the checkpoint path waits in the collapsed accordion
    page.screenshot(path=str(shots / "start.png"))


def test_vlm_tab(page, shots, tmp_path):
    elem = browser.open_tab(page, "vlm")
    page.get_by_label("(none: use my upload)").check()  # no upload and no example: nothing to look at
    kind, message = browser.run_and_wait(page, elem)
    assert kind == "error" and "no image" in message

    clear = "#vlm-files button[aria-label='Clear'], #vlm-files button[title='Clear']"
    # an upload, then cleared with X: the preview and the message go back to the chosen example
    page.get_by_label("shapes scene 1 (image)").check()
    from mmspec.demos import vlm_tab

    vlm_tab.example_inputs("shapes scene 2 (image)")[0][0].save(tmp_path / "scene.png")
    page.locator("#vlm-files input[type=file]").set_input_files(str(tmp_path / "scene.png"))
    page.wait_for_function("() => document.querySelector('#vlm-message').innerText.includes('uploaded an image')")
    page.locator(clear).first.click()
    page.wait_for_function("() => document.querySelector('#vlm-message').innerText.includes('upload removed')")
    assert "shapes scene 1" in page.inner_text("#vlm-message")
    # an unreadable upload: the message names the file, not the server's temp path or an exception class
    (tmp_path / "broken.png").write_bytes(b"not an image")
    page.locator("#vlm-files input[type=file]").set_input_files(str(tmp_path / "broken.png"))
    page.wait_for_function("() => document.querySelector('#vlm-message').innerText.includes('broken.png')")
    text = page.inner_text("#vlm-message")
    assert "could not read 'broken.png'" in text and "/tmp" not in text and "Error" not in text
    page.locator(clear).first.click()
    page.wait_for_function("() => document.querySelector('#vlm-message').innerText.includes('upload removed')")

    page.get_by_label("shapes clip 0 (video, 4 frames)").check()
    page.wait_for_function("() => document.querySelector('#vlm-prompt textarea').value === 'narrate the video.'")
    browser.set_field(page, "vlm-prompt", "Narrate The Video.")  # capitals read as the lower-case prompt
    browser.set_field(page, "vlm-max-new-tokens", 30)
    kind, message = browser.run_and_wait(page, elem)
    assert kind in ("ok", "warn"), message
    answer = page.inner_text("#vlm-answer")
    assert len(answer.split()) > 5  # the streamed speculative answer, flowing text
    assert page.locator("#vlm-answer .mmspec-answer").count() == 1
    assert page.locator("#vlm-baseline textarea").input_value().strip()  # the baseline answer
    stats = page.inner_text("#vlm-stats")
    for text in ("speedup", "mean accepted length", "target calls", "wall time", "same text as the baseline"):
        assert text in stats
    card = page.inner_text("#vlm-card")
    assert "the baseline" in card and "range" in card and "target calls" in card
    assert page.locator("#vlm-preview img").count() == 4  # the clip's frames
    _screenshot(page, shots, "vlm.png", elem)


def _image_tab(page, shots, family: str, bad_field: str, bad_value, expected: str, method_label: str,
               example: str) -> None:
    elem = browser.open_tab(page, family)
    _open_advanced(page, elem)
    path_field = f"{elem}-path"
    good_path = page.locator(f"#{path_field} input, #{path_field} textarea").first.input_value()
    browser.set_field(page, bad_field, bad_value)
    kind, message = browser.run_and_wait(page, elem)
    assert kind == "error" and expected in message, message
    if bad_field == path_field:
        browser.set_field(page, path_field, good_path)
    else:  # back to the checkpoint's setting
        browser.set_field(page, bad_field, "")
    page.click(f"#{elem}-advanced button, #{elem}-advanced .label-wrap")  # collapse it again
    page.locator(f"#{elem}-examples").get_by_text(example, exact=True).first.click()  # a clickable example
    page.wait_for_function("([id, text]) => document.querySelector(`#${id} textarea`).value === text",
                           arg=[f"{elem}-prompt", example])
    kind, message = browser.run_and_wait(page, elem)
    assert kind in ("ok", "warn"), message
    page.wait_for_selector(f"#{elem}-gallery img")
    stats = page.inner_text(f"#{elem}-stats")
    for text in ("speedup", "mean accepted length", "target calls", "wall time", f"speculative ({method_label})"):
        assert text in stats
    assert "target calls" in page.inner_text(f"#{elem}-card")
    _screenshot(page, shots, f"{family}.png", elem)


def test_ar_image_tab(page, shots):
    _image_tab(page, shots, "ar_image", "ar-image-path", "/no/such/checkpoint", "does not exist", "eagle",
               "a red circle")


def test_continuous_tab(page, shots):
    _image_tab(page, shots, "continuous", "continuous-gamma", 0, "CSpD gamma", "cspd", "a red circle")


def test_two_tabs_started_together_run_one_after_the_other(page):
    """Run in the AR image tab, then at once in the video tab: the video tab says it waits for the other
    run, and both finish (the app's single generation queue)."""
    browser.open_tab(page, "ar_image")
    page.click("#ar-image-run")
    elem = browser.open_tab(page, "video")
    page.click("#video-run")
    page.wait_for_function("""() => {
        const box = document.querySelector('#video-message .mmspec-message');
        return box && /^(waiting|starting)/.test(box.innerText); }""")
    notice = page.inner_text("#video-message .mmspec-message")
    # on a loaded machine the AR run may not have taken the slot yet: then the video run starts first and the
    # AR run is the one that waits; either way one waits for the other, never both at once
    assert notice.startswith("starting") or "waiting: a run in the AR image tab is in progress" in notice, notice
    page.wait_for_function("""() => ['ok', 'warn', 'error'].some((kind) =>
        document.querySelector('#video-message .mmspec-message-' + kind))""", timeout=600_000)
    assert page.locator("#video-message .mmspec-message-error").count() == 0, page.inner_text("#video-message")
    browser.open_tab(page, "ar_image")
    assert page.locator("#ar-image-message .mmspec-message-error").count() == 0
    assert elem == "video"


def test_video_tab(server, page, shots):
    elem = browser.open_tab(page, "video")
    _open_advanced(page, elem)
    browser.set_field(page, "video-path", "mmspec/no-such-entry")
    kind, message = browser.run_and_wait(page, elem)
    assert kind == "error" and "unknown zoo id 'mmspec/no-such-entry'" in message

    browser.set_field(page, "video-path", server[1]["video"])
    page.click(f"#{elem}-advanced button, #{elem}-advanced .label-wrap")
    browser.set_field(page, "video-tau", 0)
    kind, message = browser.run_and_wait(page, elem)
    assert kind in ("ok", "warn"), message
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
        assert image.bounding_box()["width"] >= 190  # a useful size
        shots_of_image = set()  # and the browser plays it: the picture changes (frames are 250 ms apart)
        for _ in range(20):
            shots_of_image.add(image.screenshot())
            if len(shots_of_image) > 1:
                break
            page.wait_for_timeout(100)
        assert len(shots_of_image) > 1, "the GIF does not play"
    assert page.locator("#video-strip img").bounding_box()["width"] >= 500  # the strip spans the page
    blocks = page.inner_text("#video-block-strip")
    assert "block 0" in blocks and "reward" in blocks and "tau = 0" in blocks
    stats = page.inner_text("#video-stats")
    for text in ("speedup", "target calls", "wall time", "blocks from the drafter", "speculative (sdvg)"):
        assert text in stats
    _screenshot(page, shots, "video.png", elem)
