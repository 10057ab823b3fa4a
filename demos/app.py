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
from dataclasses import dataclass
from typing import Any

import gradio as gr

from mmspec.demos import ar_image_tab, continuous_tab, video_tab, vlm_tab
from mmspec.demos.common import (
    FAMILIES,
    MAP_LEGEND,
    DemoError,
    PipelineCache,
    import_pipeline_modules,
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



def optional_number(label: str, elem_id: str) -> Any:
    """A text field for a setting the checkpoint stores: empty keeps the stored value (a gr.Number cannot be
    empty: the page would send 0), a number replaces it."""
    return gr.Textbox(value="", placeholder="the checkpoint's setting", label=label, elem_id=elem_id)

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


def _prompt_box(elem: str, value: str, label: str = "prompt(s), one per line") -> gr.Textbox:
    return gr.Textbox(value=value, lines=2, label=label, elem_id=f"{elem}-prompt")


def _sampling_row(elem: str, greedy: bool) -> dict[str, Any]:
    """The seed, greedy and temperature fields (by input name)."""
    return {"seed": gr.Number(value=0, precision=0, label="seed", elem_id=f"{elem}-seed"),
            "greedy": gr.Checkbox(value=greedy, label="greedy", elem_id=f"{elem}-greedy"),
            "temperature": gr.Number(value=1.0, label="temperature (sampling)", elem_id=f"{elem}-temperature")}


def _tree_row(elem: str) -> dict[str, Any]:
    """The EAGLE-2 dynamic tree fields (by input name)."""
    return {"use_tree": gr.Checkbox(value=False, label="EAGLE-2 dynamic tree", elem_id=f"{elem}-tree"),
            "tree_depth": gr.Number(value=5, precision=0, label="tree depth"),
            "tree_top_k": gr.Number(value=8, precision=0, label="tree top-k"),
            "tree_total_tokens": gr.Number(value=48, precision=0, label="tree total tokens")}


def _image_galleries(elem: str, label: str) -> dict[str, gr.Image]:
    """The speculative images with their acceptance maps next to the baseline's images (by result field)."""
    with gr.Row(equal_height=False):
        gallery = gr.Image(label=label, type="pil", format="png", interactive=False, elem_id=f"{elem}-gallery", scale=2)
        baseline = gr.Image(label="baseline (target only, same seed)", type="pil", format="png", interactive=False,
                            elem_id=f"{elem}-baseline", scale=1)
    gr.HTML(legend_html(MAP_LEGEND))
    return {"gallery": gallery, "baseline": baseline}


@dataclass
class _TabLayout:
    """The components every tab has, plus its own: ``inputs`` (by the tab function's keyword names,
    "path" included) and ``outputs`` (by the result's field names)."""

    inputs: dict[str, Any]
    outputs: dict[str, Any]
    run: gr.Button
    message: gr.HTML
    stats: gr.HTML


def _tab_layout(family: str, paths: dict[str, str], intro: str, build_inputs: Callable[[str], dict[str, Any]],
                build_outputs: Callable[[str], dict[str, Any]]) -> _TabLayout:
    """A tab's page: the intro, then a left column (checkpoint path, ``build_inputs(elem)``, the Run button)
    and a right column (message area, ``build_outputs(elem)``, statistics). Element ids start with the
    family's name (``ar_image`` -> ``ar-image-run``, ...), which the browser tests address."""
    elem = family.replace("_", "-")
    gr.Markdown(intro)
    with gr.Row():
        with gr.Column(scale=2):
            path = _path_box(family, paths, elem)
            inputs = {"path": path, **build_inputs(elem)}
            run = gr.Button("Run", variant="primary", elem_id=f"{elem}-run")
        with gr.Column(scale=3):
            message = gr.HTML(elem_id=f"{elem}-message")
            outputs = build_outputs(elem)
            stats = gr.HTML(elem_id=f"{elem}-stats")
    return _TabLayout(inputs, outputs, run, message, stats)


def _generation_tab(family: str, cache: PipelineCache, paths: dict[str, str], intro: str,
                    run: Callable[..., Any], input_names: Sequence[str], build_inputs: Callable[[str], dict[str, Any]],
                    build_outputs: Callable[[str], dict[str, Any]], label: Callable[[Any], str] | None = None
                    ) -> tuple[gr.Textbox, gr.HTML]:
    """A tab whose Run calls ``run(cache, **inputs)`` once (:func:`_handler`) and shows the result's fields
    named like the outputs, its statistics panel and "done: <label> <speedup>x over the baseline" (label:
    the method's name unless ``label(comparison)`` says otherwise)."""
    layout = _tab_layout(family, paths, intro, build_inputs, build_outputs)
    fields = list(layout.outputs)

    def show(result: Any) -> list[Any]:
        comparison = result.comparison
        name = label(comparison) if label is not None else comparison.method
        return [*(getattr(result, field) for field in fields), result.stats_html,
                message_html(f"done: {name} {comparison.speedup:.2f}x over the baseline", "ok")]

    layout.run.click(_handler(run, input_names, cache, show, len(fields) + 2),
                     [layout.inputs[name] for name in input_names], [*layout.outputs.values(), layout.stats,
                                                                     layout.message])
    return layout.inputs["path"], layout.message


# ----------------------------------------------------------------------------------------------------
# tabs
# ----------------------------------------------------------------------------------------------------


def _vlm_tab(cache: PipelineCache, paths: dict[str, str]) -> tuple[gr.Textbox, gr.HTML]:
    def inputs(elem: str) -> dict[str, Any]:
        with gr.Row():
            files = gr.File(file_count="multiple", label="image or video frames", elem_id=f"{elem}-files")
            example = gr.Radio([*vlm_tab.EXAMPLES, vlm_tab.NO_EXAMPLE], value=next(iter(vlm_tab.EXAMPLES)),
                               label="or a shapes example", elem_id=f"{elem}-example")
        preview = gr.Gallery(vlm_tab.example_inputs(next(iter(vlm_tab.EXAMPLES)))[0], label="input", columns=4,
                             height=140, object_fit="contain", fit_columns=False, format="png",
                             elem_id=f"{elem}-preview", interactive=False)
        fields = {"files": files, "example": example, "preview": preview,
                  "prompt": gr.Textbox(value=vlm_tab.PROMPTS["image"], label="prompt", elem_id=f"{elem}-prompt")}
        with gr.Row():
            fields["method"] = gr.Dropdown(list(vlm_tab.METHODS), value="eagle", label="method",
                                           elem_id=f"{elem}-method")
            fields["max_new_tokens"] = gr.Number(value=200, precision=0, label="max new tokens",
                                                 elem_id=f"{elem}-max-new-tokens")
            fields["num_draft_tokens"] = optional_number(label="K (draft tokens; FLASH: per forward)",
                                                         elem_id=f"{elem}-k")
        with gr.Row():
            fields.update(_sampling_row(elem, greedy=True))
        with gr.Row():
            fields.update(_tree_row(elem))
        return fields

    def outputs(elem: str) -> dict[str, Any]:
        answer = gr.HighlightedText(label="speculative answer (streamed)", color_map={vlm_tab.DRAFT_LABEL: "#ec4899"},
                                    show_legend=True, combine_adjacent=False, elem_id=f"{elem}-answer")
        baseline = gr.Textbox(label="baseline answer (target only)", lines=4, interactive=False,
                              elem_id=f"{elem}-baseline")
        return {"answer": answer, "baseline": baseline}

    layout = _tab_layout("vlm", paths, "Upload an image (or a few video frames, in order), or pick a shapes example; "
                         "the answer streams with the **accepted draft tokens highlighted**, then the target-only "
                         "baseline runs.", inputs, outputs)
    files, example, preview = layout.inputs["files"], layout.inputs["example"], layout.inputs["preview"]
    message = layout.message

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

    example.change(on_example, [example, files], [preview, layout.inputs["prompt"]])
    files.change(on_upload, files, [preview, message])

    def handle(*values: Any) -> Any:  # a generator: the status line is the progress indication
        kwargs = dict(zip(vlm_tab.INPUTS, values))
        try:
            for view in vlm_tab.run_vlm(cache, **kwargs):
                kind = "ok" if view.done else "info"
                yield view.highlighted, view.baseline or None, view.stats_html, message_html(view.status, kind)
        except Exception as error:  # noqa: BLE001 - the page shows it; the app keeps running
            yield _error_outputs(4, error)

    layout.run.click(handle, [layout.inputs[name] for name in vlm_tab.INPUTS],
                     [*layout.outputs.values(), layout.stats, message])
    return layout.inputs["path"], message


def _ar_image_tab(cache: PipelineCache, paths: dict[str, str]) -> tuple[gr.Textbox, gr.HTML]:
    def inputs(elem: str) -> dict[str, Any]:
        fields = {"prompt": _prompt_box(elem, ar_image_tab.EXAMPLE_PROMPTS[2])}
        with gr.Row():
            fields["method"] = method = gr.Dropdown(list(ar_image_tab.METHODS), value="eagle", label="method",
                                                    elem_id=f"{elem}-method")
            fields["num_images"] = gr.Number(value=1, precision=0, label="images per prompt",
                                             elem_id=f"{elem}-num-images")
            fields["guidance_scale"] = gr.Number(value=3.0, label="guidance scale", elem_id=f"{elem}-guidance")
        with gr.Row():
            fields.update(_sampling_row(elem, greedy=False))
        # the method's settings are the checkpoint's stored ones (speculation_config.json); a field left empty
        # keeps the stored value, a value replaces it (ar_image_tab.method_config)
        gr.Markdown("Method settings: the checkpoint's recommended ones; fill a field to change that setting.")
        with gr.Group(visible=True) as eagle_group:
            with gr.Row():
                fields["num_draft_tokens"] = optional_number(label="K (draft tokens, chains)",
                                                       elem_id=f"{elem}-k")
                fields["lookup_tail"] = optional_number(label="lookup tail (free copies of the row above; 0: none)",
                                                  elem_id=f"{elem}-lookup-tail")
                fields.update(_tree_row(elem))
        with gr.Group(visible=False) as lantern_group, gr.Row():
            fields["lantern_k"] = optional_number(label="LANTERN k (codebook neighbours)",
                                            elem_id=f"{elem}-lantern-k")
            fields["lantern_delta"] = optional_number(label="LANTERN delta (TV budget)",
                                                elem_id=f"{elem}-lantern-delta")
            fields["lantern_lam"] = optional_number(label="LANTERN++ bound lam (0: use delta)",
                                              elem_id=f"{elem}-lantern-lam")
            fields["argmax_drafts"] = gr.Checkbox(value=True, label="argmax drafts (sampling)",
                                                  elem_id=f"{elem}-argmax-drafts")
        with gr.Group(visible=False) as jacobi_group, gr.Row():
            fields["sjd_window"] = optional_number(label="Jacobi window (SJD/GSD)",
                                             elem_id=f"{elem}-window")
            fields["gsd_group_size"] = optional_number(label="GSD group size G",
                                                 elem_id=f"{elem}-gsd-g")
        with gr.Group(visible=False) as mulo_group, gr.Row():
            fields["mulo_tau"] = optional_number(label="MuLo tau (pooled threshold)", elem_id=f"{elem}-mulo-tau")
            fields["mulo_radius"] = optional_number(label="MuLo radius l",
                                              elem_id=f"{elem}-mulo-radius")
            fields["mulo_resample"] = gr.Dropdown(
                choices=[("the checkpoint's", ar_image_tab.STORED), ("parallel (the paper's; costs quality)", "parallel"),
                         ("sequential (keeps quality, slower)", "sequential"),
                         ("reverify (raster + Jacobi passes)", "reverify")],
                value=ar_image_tab.STORED, label="MuLo resampling", elem_id=f"{elem}-mulo-resample")

        def on_method(name: str) -> list[Any]:
            return [gr.update(visible=name in ("eagle", "lantern")), gr.update(visible=name == "lantern"),
                    gr.update(visible=name in ("sjd", "gsd")), gr.update(visible=name == "mulo")]

        method.change(on_method, method, [eagle_group, lantern_group, jacobi_group, mulo_group])
        return fields

    return _generation_tab(
        "ar_image", cache, paths, "Text-to-image with a discrete AR model (LlamaGen-style). One prompt per line makes "
        "a batch. Each speculative image is followed by its **acceptance map**.", ar_image_tab.run_ar_image,
        ar_image_tab.INPUTS, inputs, lambda elem: _image_galleries(elem, "speculative: images | acceptance maps"))


def _continuous_tab(cache: PipelineCache, paths: dict[str, str]) -> tuple[gr.Textbox, gr.HTML]:
    def inputs(elem: str) -> dict[str, Any]:
        fields = {"prompt": _prompt_box(elem, "a red circle", "prompt(s), one per line (class ids for "
                                        "class-conditioned models)")}
        with gr.Row():
            fields["method"] = gr.Dropdown(list(continuous_tab.METHODS), value="cspd", label="method",
                                           elem_id=f"{elem}-method")
            fields["draft_length"] = optional_number(label="CSpD gamma (draft iterations per target pass)",
                                                     elem_id=f"{elem}-gamma")
            fields["num_images"] = gr.Number(value=2, precision=0, label="batch (images per prompt)",
                                             elem_id=f"{elem}-batch")
        with gr.Row():
            fields["seed"] = gr.Number(value=0, precision=0, label="seed", elem_id=f"{elem}-seed")
            fields["num_iter"] = gr.Number(value=0, precision=0, label="MAR iterations (0: one token each)",
                                           elem_id=f"{elem}-num-iter")
            fields["temperature"] = gr.Number(value=1.0, label="temperature", elem_id=f"{elem}-temperature")
            fields["guidance_scale"] = gr.Number(value=1.0, label="guidance scale", elem_id=f"{elem}-guidance")
        with gr.Row():
            fields["verify_order"] = gr.Dropdown([("the checkpoint's", continuous_tab.STORED),
                                                  *continuous_tab.VERIFY_ORDERS],
                                                 value=continuous_tab.STORED, label="verification order")
            fields["verify_context"] = gr.Dropdown([("the checkpoint's", continuous_tab.STORED),
                                                    *continuous_tab.VERIFY_CONTEXTS],
                                                   value=continuous_tab.STORED, label="target context")
        return fields

    return _generation_tab(
        "continuous", cache, paths, "Text-to-image with a MAR-style model over **continuous** tokens; CSpD drafts "
        "gamma MAR iterations with a small MAR and verifies them in one target pass.", continuous_tab.run_continuous,
        continuous_tab.INPUTS, inputs, lambda elem: _image_galleries(elem, "CSpD: images | acceptance maps"),
        label=lambda comparison: "CSpD")


def _video_tab(cache: PipelineCache, paths: dict[str, str]) -> tuple[gr.Textbox, gr.HTML]:
    def inputs(elem: str) -> dict[str, Any]:
        fields = {"prompt": _prompt_box(elem, video_tab.EXAMPLE_PROMPTS[0])}
        with gr.Row():
            fields["method"] = gr.Dropdown(list(video_tab.METHODS), value="sdvg", label="method",
                                           elem_id=f"{elem}-method")
            fields["tau"] = optional_number(label="tau (reward threshold)", elem_id=f"{elem}-tau")
            fields["reward"] = gr.Dropdown([("the checkpoint's", video_tab.STORED), *video_tab.REWARDS],
                                           value=video_tab.STORED, label="reward", elem_id=f"{elem}-reward")
        fields["reward_weights"] = gr.Textbox(
            value="", label="reward weights (ImageReward: a folder with ImageReward.pt, med_config.json, "
            "tokenizer/; CLIP: MODEL:FILE; shapes: none)", elem_id=f"{elem}-reward-weights")
        with gr.Row():
            fields["aggregate"] = gr.Dropdown([("the checkpoint's", video_tab.STORED), *video_tab.AGGREGATES],
                                              value=video_tab.STORED, label="aggregate over frames")
            fields["force_reject_first"] = gr.Dropdown([("the checkpoint's", video_tab.STORED), *video_tab.FIRST_BLOCK],
                                                       value=video_tab.STORED, label="first block always by the target",
                                                       elem_id=f"{elem}-first")
            fields["refine_rejected_from"] = optional_number(
                label="target refines rejected drafts from timestep (0: redraws them from noise)",
                elem_id=f"{elem}-refine")
        with gr.Row():
            fields["seed"] = gr.Number(value=0, precision=0, label="seed", elem_id=f"{elem}-seed")
            fields["num_videos"] = gr.Number(value=1, precision=0, label="videos per prompt", elem_id=f"{elem}-videos")
            fields["num_blocks"] = gr.Number(value=0, precision=0, label="blocks (0: all)", elem_id=f"{elem}-num-blocks")
            fields["num_inference_steps"] = gr.Number(value=4, precision=0, label="denoising steps per block",
                                                      elem_id=f"{elem}-steps")
            # the zoo's pair draws the prompt in far more frames with guidance 3 (docs/pipeline_video.md)
            fields["guidance_scale"] = gr.Number(value=3.0, label="guidance scale", elem_id=f"{elem}-guidance")
        return fields

    def animated(label: str, elem_id: str) -> gr.Image:
        # a .gif path: the browser plays it (type="pil" would keep only its first frame)
        return gr.Image(label=f"{label}, animated", type="filepath", interactive=False, elem_id=elem_id, scale=1,
                        min_width=180, buttons=["download", "fullscreen"])

    def outputs(elem: str) -> dict[str, Any]:
        with gr.Row(equal_height=False):
            spec_animation = animated("speculative", f"{elem}-animation")
            spec_strip = gr.Image(label="speculative: frames (bar under each block: who made it)", type="pil",
                                  format="png", interactive=False, elem_id=f"{elem}-strip", scale=3)
        blocks_html = gr.HTML(elem_id=f"{elem}-block-strip")
        with gr.Row(equal_height=False):
            base_animation = animated("baseline", f"{elem}-baseline-animation")
            base_strip = gr.Image(label="baseline (target only, same seed)", type="pil", format="png",
                                  interactive=False, elem_id=f"{elem}-baseline", scale=3)
        return {"spec_animation": spec_animation, "spec_strip": spec_strip, "blocks_html": blocks_html,
                "base_animation": base_animation, "base_strip": base_strip}

    return _generation_tab(
        "video", cache, paths, "Text-to-video with a block-causal AR video model. SDVG: the drafter proposes each "
        "block, a reward model scores its frames (worst frame by default), blocks scoring >= tau are kept, the "
        f"target regenerates the others. Each run's videos play in a loop at {video_tab.ANIMATION_FPS} fps (side by "
        "side, one row per prompt, a playhead under them) next to their film strip.", video_tab.run_video,
        video_tab.INPUTS, inputs, outputs)


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
    import_pipeline_modules()  # before any handler thread imports them (lazy loaders are not thread-safe)
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
           block: bool = True, quiet: bool = False, cache: PipelineCache | None = None) -> tuple[gr.Blocks, str]:
    """Build and serve the page on ``host:port`` (127.0.0.1 by default: not reachable from other machines).
    ``block=False`` returns right after start-up (tests); ``cache``: where and how pipelines load (device,
    precision; default: the machine's default device). Returns ``(app, local url)``."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    demo = build_app(paths, cache)
    demo.queue(default_concurrency_limit=1)
    _, url, _ = demo.launch(server_name=host, server_port=port, prevent_thread_lock=not block, quiet=quiet,
                            css=CSS, show_error=True, footer_links=[], ssr_mode=False)
    return demo, url
