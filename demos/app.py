"""The Gradio page: one tab per pipeline family, wired to the tab functions of this package.

    mmspec demo                                   # http://127.0.0.1:7860, the bundled zoo
    mmspec demo --vlm /ckpt/llava-eagle --port 8000

or from Python::

    from mmspec.demos.app import build_app, launch
    launch({"ar_image": "mmspec/shapes-t2i", "vlm": "/ckpt/llava-vispec"})

Every handler catches errors and shows their message in the tab's message area, so bad input never
takes the app down. Only this module imports gradio.
"""

from __future__ import annotations

import html
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import gradio as gr

from mmspec.demos import ar_image_tab, continuous_tab, video_tab, vlm_tab
from mmspec.demos.common import (
    FAMILIES,
    MAP_LEGEND,
    DemoError,
    PipelineCache,
    legend_html,
    resolve_checkpoint,
    user_message,
)

logger = logging.getLogger("mmspec.demos")

TITLE = "mmspec: speculative decoding for multimodal models"
CSS = """
.mmspec-stats table, .mmspec-blocks table { border-collapse: collapse; margin: 4px 0; }
.mmspec-stats th, .mmspec-stats td, .mmspec-blocks th, .mmspec-blocks td {
    border: 1px solid #d4d4d8; padding: 4px 10px; text-align: left; font-size: 14px; }
.mmspec-stats thead th { background: #f4f4f5; }
.mmspec-notes { font-size: 12px; color: #52525b; margin: 6px 0 0 16px; }
.mmspec-legend { display: flex; gap: 16px; font-size: 13px; margin: 4px 0; }
.mmspec-legend-item { display: inline-flex; align-items: center; gap: 6px; }
.mmspec-swatch { width: 14px; height: 14px; border-radius: 3px; display: inline-block; }
.mmspec-message { padding: 6px 10px; border-radius: 6px; font-size: 14px; }
.mmspec-message-error { background: #fef2f2; color: #991b1b; border: 1px solid #fecaca; }
.mmspec-message-ok { background: #f0fdf4; color: #166534; border: 1px solid #bbf7d0; }
.mmspec-message-info { background: #f4f4f5; color: #3f3f46; border: 1px solid #e4e4e7; }
"""
INTRO = """# mmspec demo
Speculative decoding for vision-language models, discrete and continuous AR image generators and AR video.
Every run shows the **speculative result next to the target-only baseline** run on the same inputs and seed,
with wall time, speedup, mean accepted length and target calls. Each tab loads the bundled zoo entry by
default (offline); type a saved pipeline folder in *checkpoint path* to load real checkpoints.
"""


def message_html(text: str, kind: str = "info") -> str:
    """The tab's message area: ``kind`` is "error", "ok" or "info"."""
    return f"<div class='mmspec-message mmspec-message-{kind}'>{html.escape(text)}</div>"


def checkpoint_status(family: str, path: str) -> str:
    """Message shown when the page opens: whether the tab's checkpoint exists (nothing is loaded yet)."""
    try:
        folder = resolve_checkpoint(family, path)
    except DemoError as error:
        return message_html(f"{error} Type another checkpoint path to use this tab.", "error")
    return message_html(f"checkpoint: {path} ({folder}); press Run (the first run loads it).", "info")


def _error_outputs(count: int, error: BaseException) -> list[Any]:
    """Cleared result components plus the error message (last output)."""
    if not isinstance(error, (DemoError, ValueError, FileNotFoundError, NotImplementedError)):
        logger.exception("demo run failed")
    return [None] * (count - 1) + [message_html(user_message(error), "error")]


def _handler(run: Callable[..., Any], names: Sequence[str], cache: PipelineCache,
             show: Callable[[Any], list[Any]], num_outputs: int) -> Callable[..., Any]:
    """A click handler: inputs by name -> ``run(cache, **inputs, report=...)`` -> ``show(result)``."""

    def handle(*values: Any, progress: gr.Progress = gr.Progress()) -> list[Any]:  # noqa: B008 - gradio's API
        try:
            result = run(cache, **dict(zip(names, values)), report=lambda f, text: progress(f, desc=text))
        except Exception as error:  # noqa: BLE001 - the page shows it; the app keeps running
            return _error_outputs(num_outputs, error)
        return show(result)

    return handle


def _path_box(family: str, paths: dict[str, str], elem: str) -> gr.Textbox:
    return gr.Textbox(value=paths.get(family, FAMILIES[family][2]), label="checkpoint path",
                      info="a saved pipeline folder (model_index.json) or a zoo id", elem_id=f"{elem}-path")


def _sampling_row(elem: str, greedy: bool) -> tuple[gr.Number, gr.Checkbox, gr.Number]:
    seed = gr.Number(value=0, precision=0, label="seed", elem_id=f"{elem}-seed")
    greedy_box = gr.Checkbox(value=greedy, label="greedy", elem_id=f"{elem}-greedy")
    temperature = gr.Number(value=1.0, label="temperature (sampling)", elem_id=f"{elem}-temperature")
    return seed, greedy_box, temperature


def _tree_row(elem: str) -> tuple[gr.Checkbox, gr.Number, gr.Number, gr.Number]:
    use_tree = gr.Checkbox(value=False, label="EAGLE-2 dynamic tree", elem_id=f"{elem}-tree")
    depth = gr.Number(value=5, precision=0, label="tree depth")
    top_k = gr.Number(value=8, precision=0, label="tree top-k")
    total = gr.Number(value=48, precision=0, label="tree total tokens")
    return use_tree, depth, top_k, total


def _image_galleries(elem: str, label: str) -> tuple[gr.Image, gr.Image]:
    """The speculative images with their acceptance maps next to the baseline's images."""
    with gr.Row(equal_height=False):
        gallery = gr.Image(label=label, type="pil", format="png", interactive=False, elem_id=f"{elem}-gallery", scale=2)
        baseline = gr.Image(label="baseline (target only, same seed)", type="pil", format="png", interactive=False,
                            elem_id=f"{elem}-baseline", scale=1)
    gr.HTML(legend_html(MAP_LEGEND))
    return gallery, baseline


# ----------------------------------------------------------------------------------------------------
# tabs
# ----------------------------------------------------------------------------------------------------


def _vlm_tab(cache: PipelineCache, paths: dict[str, str]) -> tuple[gr.Textbox, gr.HTML]:
    elem = "vlm"
    gr.Markdown("Upload an image (or a few video frames, in order), or pick a shapes example; the answer "
                "streams with the **accepted draft tokens highlighted**, then the target-only baseline runs.")
    with gr.Row():
        with gr.Column(scale=2):
            path = _path_box("vlm", paths, elem)
            with gr.Row():
                files = gr.File(file_count="multiple", label="image or video frames", elem_id=f"{elem}-files")
                example = gr.Radio([*vlm_tab.EXAMPLES, vlm_tab.NO_EXAMPLE], value=next(iter(vlm_tab.EXAMPLES)),
                                   label="or a shapes example", elem_id=f"{elem}-example")
            preview = gr.Gallery(vlm_tab.example_inputs(next(iter(vlm_tab.EXAMPLES)))[0], label="input", columns=4,
                                 height=140, format="png", elem_id=f"{elem}-preview", interactive=False)
            prompt = gr.Textbox(value=vlm_tab.PROMPTS["image"], label="prompt", elem_id=f"{elem}-prompt")
            with gr.Row():
                method = gr.Dropdown(list(vlm_tab.METHODS), value="eagle", label="method", elem_id=f"{elem}-method")
                max_new = gr.Number(value=200, precision=0, label="max new tokens", elem_id=f"{elem}-max-new-tokens")
                k = gr.Number(value=6, precision=0, label="K (draft tokens; FLASH: per forward)", elem_id=f"{elem}-k")
            with gr.Row():
                seed, greedy, temperature = _sampling_row(elem, greedy=True)
            with gr.Row():
                use_tree, depth, top_k, total = _tree_row(elem)
            run = gr.Button("Run", variant="primary", elem_id=f"{elem}-run")
        with gr.Column(scale=3):
            message = gr.HTML(elem_id=f"{elem}-message")
            answer = gr.HighlightedText(label="speculative answer (streamed)", color_map={vlm_tab.DRAFT_LABEL: "#ec4899"},
                                        show_legend=True, combine_adjacent=False, elem_id=f"{elem}-answer")
            baseline = gr.Textbox(label="baseline answer (target only)", lines=4, interactive=False,
                                  elem_id=f"{elem}-baseline")
            stats = gr.HTML(elem_id=f"{elem}-stats")

    def on_example(name: str, uploaded: Any) -> tuple[Any, Any]:
        if uploaded:  # uploads win over examples; keep showing them
            return gr.update(), gr.update()
        if not name or name == vlm_tab.NO_EXAMPLE:
            return None, gr.update()
        frames, text = vlm_tab.example_inputs(name)
        return frames, text

    def on_upload(uploaded: Any) -> tuple[Any, Any]:
        try:
            frames = vlm_tab.read_uploads(uploaded)
        except DemoError as error:
            return None, message_html(str(error), "error")
        if not frames:
            return gr.update(), gr.update()
        kind = "image" if len(frames) == 1 else f"video of {len(frames)} frames"
        return frames, message_html(f"uploaded: {kind} (used instead of the example)", "info")

    example.change(on_example, [example, files], [preview, prompt])
    files.change(on_upload, files, [preview, message])

    def handle(*values: Any) -> Any:  # a generator: the status line is the progress indication
        kwargs = dict(zip(vlm_tab.INPUTS, values))
        try:
            for view in vlm_tab.run_vlm(cache, **kwargs):
                kind = "ok" if view.done else "info"
                yield view.highlighted, view.baseline or None, view.stats_html, message_html(view.status, kind)
        except Exception as error:  # noqa: BLE001 - the page shows it; the app keeps running
            yield _error_outputs(4, error)

    inputs = [path, files, example, prompt, method, max_new, seed, greedy, temperature, k, use_tree, depth, top_k,
              total]
    run.click(handle, inputs, [answer, baseline, stats, message])
    return path, message


def _ar_image_tab(cache: PipelineCache, paths: dict[str, str]) -> tuple[gr.Textbox, gr.HTML]:
    elem = "ar-image"
    gr.Markdown("Text-to-image with a discrete AR model (LlamaGen-style). One prompt per line makes a batch. "
                "Each speculative image is followed by its **acceptance map**.")
    with gr.Row():
        with gr.Column(scale=2):
            path = _path_box("ar_image", paths, elem)
            prompt = gr.Textbox(value=ar_image_tab.EXAMPLE_PROMPTS[2], lines=2,
                                label="prompt(s), one per line", elem_id=f"{elem}-prompt")
            with gr.Row():
                method = gr.Dropdown(list(ar_image_tab.METHODS), value="eagle", label="method", elem_id=f"{elem}-method")
                num_images = gr.Number(value=1, precision=0, label="images per prompt", elem_id=f"{elem}-num-images")
                guidance = gr.Number(value=3.0, label="guidance scale", elem_id=f"{elem}-guidance")
            with gr.Row():
                seed, greedy, temperature = _sampling_row(elem, greedy=False)
            with gr.Group(visible=True) as eagle_group:
                with gr.Row():
                    k = gr.Number(value=8, precision=0, label="K (draft tokens, chains)", elem_id=f"{elem}-k")
                    use_tree, depth, top_k, total = _tree_row(elem)
            with gr.Group(visible=False) as lantern_group, gr.Row():
                lantern_k = gr.Number(value=64, precision=0, label="LANTERN k (codebook neighbours)",
                                      elem_id=f"{elem}-lantern-k")
                lantern_delta = gr.Number(value=0.2, label="LANTERN delta (TV budget)", elem_id=f"{elem}-lantern-delta")
            with gr.Group(visible=False) as jacobi_group, gr.Row():
                window = gr.Number(value=16, precision=0, label="Jacobi window (SJD/GSD)", elem_id=f"{elem}-window")
                group_size = gr.Number(value=10, precision=0, label="GSD group size G", elem_id=f"{elem}-gsd-g")
            with gr.Group(visible=False) as mulo_group, gr.Row():
                mulo_tau = gr.Number(value=0.3, label="MuLo tau (pooled threshold)", elem_id=f"{elem}-mulo-tau")
                mulo_radius = gr.Number(value=1, precision=0, label="MuLo radius l", elem_id=f"{elem}-mulo-radius")
            run = gr.Button("Run", variant="primary", elem_id=f"{elem}-run")
        with gr.Column(scale=3):
            message = gr.HTML(elem_id=f"{elem}-message")
            gallery, baseline = _image_galleries(elem, "speculative: images | acceptance maps")
            stats = gr.HTML(elem_id=f"{elem}-stats")

    def on_method(name: str) -> list[Any]:
        return [gr.update(visible=name in ("eagle", "lantern")), gr.update(visible=name == "lantern"),
                gr.update(visible=name in ("sjd", "gsd")), gr.update(visible=name == "mulo")]

    method.change(on_method, method, [eagle_group, lantern_group, jacobi_group, mulo_group])
    inputs = [path, prompt, method, num_images, seed, greedy, temperature, guidance, k, use_tree, depth, top_k, total,
              lantern_k, lantern_delta, window, group_size, mulo_tau, mulo_radius]

    def show(result: ar_image_tab.ARImageResult) -> list[Any]:
        speedup = result.comparison.speedup
        return [result.gallery, result.baseline, result.stats_html,
                message_html(f"done: {result.comparison.method} {speedup:.2f}x over the baseline", "ok")]

    run.click(_handler(ar_image_tab.run_ar_image, ar_image_tab.INPUTS, cache, show, 4), inputs,
              [gallery, baseline, stats, message])
    return path, message


def _continuous_tab(cache: PipelineCache, paths: dict[str, str]) -> tuple[gr.Textbox, gr.HTML]:
    elem = "continuous"
    gr.Markdown("Text-to-image with a MAR-style model over **continuous** tokens; CSpD drafts gamma MAR "
                "iterations with a small MAR and verifies them in one target pass.")
    with gr.Row():
        with gr.Column(scale=2):
            path = _path_box("continuous", paths, elem)
            prompt = gr.Textbox(value="a red circle", lines=2, label="prompt(s), one per line (class ids for "
                                "class-conditioned models)", elem_id=f"{elem}-prompt")
            with gr.Row():
                method = gr.Dropdown(list(continuous_tab.METHODS), value="cspd", label="method",
                                     elem_id=f"{elem}-method")
                gamma = gr.Number(value=4, precision=0, label="CSpD gamma (draft iterations per target pass)",
                                  elem_id=f"{elem}-gamma")
                batch = gr.Number(value=2, precision=0, label="batch (images per prompt)", elem_id=f"{elem}-batch")
            with gr.Row():
                seed = gr.Number(value=0, precision=0, label="seed", elem_id=f"{elem}-seed")
                num_iter = gr.Number(value=0, precision=0, label="MAR iterations (0: one token each)",
                                     elem_id=f"{elem}-num-iter")
                temperature = gr.Number(value=1.0, label="temperature", elem_id=f"{elem}-temperature")
                guidance = gr.Number(value=1.0, label="guidance scale", elem_id=f"{elem}-guidance")
            with gr.Row():
                order = gr.Dropdown(list(continuous_tab.VERIFY_ORDERS), value="independent", label="verification order")
                context = gr.Dropdown(list(continuous_tab.VERIFY_CONTEXTS), value="round", label="target context")
            run = gr.Button("Run", variant="primary", elem_id=f"{elem}-run")
        with gr.Column(scale=3):
            message = gr.HTML(elem_id=f"{elem}-message")
            gallery, baseline = _image_galleries(elem, "CSpD: images | acceptance maps")
            stats = gr.HTML(elem_id=f"{elem}-stats")

    def show(result: continuous_tab.ContinuousResult) -> list[Any]:
        return [result.gallery, result.baseline, result.stats_html,
                message_html(f"done: CSpD {result.comparison.speedup:.2f}x over the baseline", "ok")]

    inputs = [path, prompt, method, batch, seed, gamma, num_iter, temperature, guidance, order, context]
    run.click(_handler(continuous_tab.run_continuous, continuous_tab.INPUTS, cache, show, 4), inputs,
              [gallery, baseline, stats, message])
    return path, message


def _video_tab(cache: PipelineCache, paths: dict[str, str]) -> tuple[gr.Textbox, gr.HTML]:
    elem = "video"
    gr.Markdown("Text-to-video with a block-causal AR video model. SDVG: the drafter proposes each block, a "
                "reward model scores its frames (worst frame by default), blocks scoring >= tau are kept, the "
                "target regenerates the others.")
    with gr.Row():
        with gr.Column(scale=2):
            path = _path_box("video", paths, elem)
            prompt = gr.Textbox(value=video_tab.EXAMPLE_PROMPTS[0], lines=2, label="prompt(s), one per line",
                                elem_id=f"{elem}-prompt")
            with gr.Row():
                method = gr.Dropdown(list(video_tab.METHODS), value="sdvg", label="method", elem_id=f"{elem}-method")
                tau = gr.Number(value=0.5, label="tau (reward threshold)", elem_id=f"{elem}-tau")
                reward = gr.Dropdown(list(video_tab.REWARDS), value="shapes", label="reward", elem_id=f"{elem}-reward")
            with gr.Row():
                aggregate = gr.Dropdown(list(video_tab.AGGREGATES), value="min", label="aggregate over frames")
                first = gr.Checkbox(value=True, label="first block always by the target", elem_id=f"{elem}-first")
            with gr.Row():
                seed = gr.Number(value=0, precision=0, label="seed", elem_id=f"{elem}-seed")
                videos = gr.Number(value=1, precision=0, label="videos per prompt", elem_id=f"{elem}-videos")
                blocks = gr.Number(value=0, precision=0, label="blocks (0: all)", elem_id=f"{elem}-num-blocks")
                steps = gr.Number(value=4, precision=0, label="denoising steps per block", elem_id=f"{elem}-steps")
                guidance = gr.Number(value=1.0, label="guidance scale", elem_id=f"{elem}-guidance")
            run = gr.Button("Run", variant="primary", elem_id=f"{elem}-run")
        with gr.Column(scale=3):
            message = gr.HTML(elem_id=f"{elem}-message")
            spec_strip = gr.Image(label="speculative: frames (bar under each block: who made it)", type="pil",
                                  format="png", interactive=False, elem_id=f"{elem}-strip")
            blocks_html = gr.HTML(elem_id=f"{elem}-block-strip")
            base_strip = gr.Image(label="baseline (target only, same seed)", type="pil", format="png",
                                  interactive=False, elem_id=f"{elem}-baseline")
            stats = gr.HTML(elem_id=f"{elem}-stats")

    def show(result: video_tab.VideoResult) -> list[Any]:
        return [result.spec_strip, result.blocks_html, result.base_strip, result.stats_html,
                message_html(f"done: {result.comparison.method} {result.comparison.speedup:.2f}x over the baseline",
                             "ok")]

    inputs = [path, prompt, method, videos, seed, tau, reward, aggregate, first, blocks, steps, guidance]
    run.click(_handler(video_tab.run_video, video_tab.INPUTS, cache, show, 5), inputs,
              [spec_strip, blocks_html, base_strip, stats, message])
    return path, message


# ----------------------------------------------------------------------------------------------------
# the app
# ----------------------------------------------------------------------------------------------------


def build_app(paths: dict[str, str] | None = None, cache: PipelineCache | None = None) -> gr.Blocks:
    """The demo page. ``paths`` maps a family ("vlm", "ar_image", "continuous", "video") to the checkpoint
    its tab loads by default (a saved pipeline folder or a zoo id; default: the zoo entry)."""
    paths = dict(paths or {})
    unknown = sorted(set(paths) - set(FAMILIES))
    if unknown:
        raise ValueError(f"paths has unknown families {unknown}; known: {list(FAMILIES)}")
    cache = cache if cache is not None else PipelineCache()
    tabs = (("VLM", "vlm", _vlm_tab), ("AR image", "ar_image", _ar_image_tab),
            ("Continuous AR image", "continuous", _continuous_tab), ("AR video", "video", _video_tab))
    with gr.Blocks(title=TITLE) as demo:
        gr.Markdown(INTRO)
        checks = []
        with gr.Tabs():
            for label, family, build in tabs:
                with gr.Tab(label, id=family, elem_id=f"tab-{family.replace('_', '-')}"):
                    path, message = build(cache, paths)
                    checks.append((family, path, message))
        for family, path, message in checks:
            demo.load(lambda p, family=family: checkpoint_status(family, p), path, message)
    demo.mmspec_cache = cache  # for tests and embedding
    return demo


def launch(paths: dict[str, str] | None = None, host: str = "127.0.0.1", port: int | None = 7860, *,
           block: bool = True, quiet: bool = False) -> tuple[gr.Blocks, str]:
    """Build and serve the page on ``host:port`` (127.0.0.1 by default: not reachable from other machines).
    ``block=False`` returns right after start-up (tests). Returns ``(app, local url)``."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    demo = build_app(paths)
    demo.queue(default_concurrency_limit=1)
    _, url, _ = demo.launch(server_name=host, server_port=port, prevent_thread_lock=not block, quiet=quiet,
                            css=CSS, show_error=True, footer_links=[], ssr_mode=False)
    return demo, url
