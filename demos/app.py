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
from mmspec.demos.timing import DEFAULT_REPEATS, MAX_REPEATS, RunSlot, speed_words

#: the highlight of accepted draft tokens in the VLM answer (the .mmspec-draft background)
DRAFT_HIGHLIGHT = (251, 207, 232)

logger = logging.getLogger("mmspec.demos")

TITLE = "mmspec: speculative decoding for multimodal models"
CSS = """
.mmspec-stats table, .mmspec-blocks table { border-collapse: collapse; margin: 4px 0; }
.mmspec-stats th, .mmspec-stats td, .mmspec-blocks th, .mmspec-blocks td {
    border: 1px solid #d4d4d8; padding: 4px 10px; text-align: left; font-size: 14px; }
.mmspec-stats thead th { background: #f4f4f5; }
.mmspec-notes { font-size: 12px; color: #52525b; margin: 6px 0 0 16px; }
.mmspec-legend { display: flex; gap: 16px; font-size: 14px; margin: 4px 0; }
.mmspec-legend-item { display: inline-flex; align-items: center; gap: 6px; }
.mmspec-swatch { width: 16px; height: 16px; border-radius: 3px; display: inline-block; }
.mmspec-message { padding: 6px 10px; border-radius: 6px; font-size: 14px; }
.mmspec-message-error { background: #fef2f2; color: #991b1b; border: 1px solid #fecaca; }
.mmspec-message-ok { background: #f0fdf4; color: #166534; border: 1px solid #bbf7d0; }
.mmspec-message-warn { background: #fffbeb; color: #92400e; border: 1px solid #fde68a; }
.mmspec-message-info { background: #f4f4f5; color: #3f3f46; border: 1px solid #e4e4e7; }
.mmspec-card { padding: 10px 14px; border-radius: 8px; border: 1px solid; }
.mmspec-card ul { margin: 4px 0 0 18px; font-size: 14px; }
.mmspec-card-title { font-size: 22px; font-weight: 700; }
.mmspec-card-ok { background: #f0fdf4; border-color: #86efac; color: #14532d; }
.mmspec-card-slow { background: #f4f4f5; border-color: #d4d4d8; color: #27272a; }
.mmspec-card-warn { background: #fffbeb; border-color: #fcd34d; color: #78350f; }
.mmspec-answer { font-size: 16px; line-height: 1.6; padding: 8px 10px; border: 1px solid #e4e4e7; border-radius: 6px;
    min-height: 60px; white-space: pre-wrap; }
.mmspec-draft { background: #fbcfe8; color: inherit; border-radius: 3px; padding: 0 1px; }
.mmspec-intro p { margin: 0; }
"""
INTRO = """## mmspec: speculative decoding for multimodal models
Each run times the speculative method against the target-only baseline on the same inputs and seed (warm-up, then
alternating runs; one run at a time in the whole app). **The bundled zoo models are tiny and know only the synthetic
shapes world** (coloured circles, squares, triangles and diamonds): other prompts or photos still give shapes. For
real images load a real checkpoint under *advanced settings > checkpoint path*.
"""
ZOO_ONLY = "The zoo model knows only the shapes world; use the examples or load a real checkpoint under advanced settings."
#: the one generation slot of the app (every tab's Run waits for it)
SLOT = RunSlot()


def optional_number(label: str, elem_id: str) -> Any:
    """A text field for a setting the checkpoint stores: empty keeps the stored value (a gr.Number cannot be
    empty: the page would send 0), a number replaces it."""
    return gr.Textbox(value="", placeholder="the checkpoint's setting", label=label, elem_id=elem_id)


def message_html(text: str, kind: str = "info") -> str:
    """The tab's message area: ``kind`` is "error", "ok", "warn" or "info"."""
    return f"<div class='mmspec-message mmspec-message-{kind}'>{html.escape(text)}</div>"


def checkpoint_status(family: str, path: str) -> str:
    """Message shown when the page opens: whether the tab's checkpoint exists and is loaded."""
    try:
        resolve_checkpoint(family, path)
    except DemoError as error:
        return message_html(f"{error} Type another checkpoint path under advanced settings to use this tab.",
                            "error")
    return message_html(f"ready: {path}. Pick an example or type a prompt, then press Run.", "info")


def _error_outputs(count: int, error: BaseException) -> list[Any]:
    """Cleared result components plus the error message (last output)."""
    if not isinstance(error, (DemoError, ValueError, FileNotFoundError, NotImplementedError)):
        logger.exception("demo run failed")
    return [None] * (count - 1) + [message_html(user_message(error), "error")]


def done_message(comparison: Any, name: str) -> str:
    """The message after a run: the speedup in words, a warning when the timing is not trusted."""
    if comparison.warning is not None:
        return message_html(f"done, but the timing is not trusted: {comparison.warning}", "warn")
    return message_html(f"done: {name} ran {speed_words(comparison.speedup)} the baseline", "ok")


def queue_notice(tab: str) -> str:
    """What a tab says when Run is pressed: whether its run waits for another one (one run at a time)."""
    holder = SLOT.holder()
    if holder is not None:
        return message_html(f"waiting: a run in the {holder} tab is in progress; this run starts when it ends (one "
                            "run at a time in the whole app, so runs never slow each other down)", "info")
    return message_html("starting...", "info")


def _handler(run: Callable[..., Any], names: Sequence[str], cache: PipelineCache,
             show: Callable[[Any], list[Any]], num_outputs: int, tab: str = "demo") -> Callable[..., Any]:
    """A click handler: inputs by name -> ``run(cache, **inputs, report=...)`` -> ``show(result)``, holding the
    app's generation slot (:data:`SLOT`) while it runs."""

    def handle(*values: Any, progress: gr.Progress = gr.Progress()) -> list[Any]:  # noqa: B008 - gradio's API
        try:
            with SLOT.hold(tab):
                result = run(cache, **dict(zip(names, values)), report=lambda f, text: progress(f, desc=text))
        except Exception as error:  # noqa: BLE001 - the page shows it; the app keeps running
            return _error_outputs(num_outputs, error)
        return show(result)

    return handle


def _click(layout: _TabLayout, tab: str, handler: Callable[..., Any], inputs: list[Any], outputs: list[Any]) -> None:
    """Run's click: say at once whether the run waits (unqueued), then the run in the app's single generation
    queue (``concurrency_id="generation"``, one at a time across every tab; gradio shows the queue position)."""
    layout.run.click(lambda: queue_notice(tab), None, layout.message, queue=False).then(
        handler, inputs, outputs, concurrency_id="generation", concurrency_limit=1)


def _path_box(family: str, paths: dict[str, str], elem: str) -> gr.Textbox:
    return gr.Textbox(value=paths.get(family, FAMILIES[family][2]), label="checkpoint path",
                      info="a saved pipeline folder (model_index.json) or a zoo id", elem_id=f"{elem}-path")


def _prompt_box(elem: str, value: str, label: str = "prompt(s), one per line") -> gr.Textbox:
    return gr.Textbox(value=value, lines=2, label=label, elem_id=f"{elem}-prompt")


def _repeats_box(elem: str) -> gr.Number:
    return gr.Number(value=DEFAULT_REPEATS, precision=0, elem_id=f"{elem}-repeats",
                     label=f"timed repeats per side, at least (1-{MAX_REPEATS}; short calls get more)")


def _tree_fields(elem: str) -> dict[str, Any]:
    """The EAGLE-2 dynamic tree box and its fields (by input name); the fields show only while it is ticked."""
    use_tree = gr.Checkbox(value=False, label="EAGLE-2 dynamic tree", elem_id=f"{elem}-tree")
    with gr.Row(visible=False) as row:
        fields = {"tree_depth": gr.Number(value=5, precision=0, label="tree depth", elem_id=f"{elem}-tree-depth"),
                  "tree_top_k": gr.Number(value=8, precision=0, label="tree top-k"),
                  "tree_total_tokens": gr.Number(value=48, precision=0, label="tree total tokens")}
    use_tree.change(lambda on: gr.update(visible=bool(on)), use_tree, row)
    return {"use_tree": use_tree, **fields}


def _image_outputs(elem: str) -> dict[str, Any]:
    """The picture of an image comparison (by result field), full width, with the acceptance map's legend."""
    gr.HTML(legend_html(MAP_LEGEND))
    gallery = gr.Image(label="one row per image: speculative, its acceptance map, the baseline (same seed)",
                       type="pil", format="png", interactive=False, elem_id=f"{elem}-gallery", show_label=False)
    return {"gallery": gallery}


@dataclass
class _TabLayout:
    """The components every tab has, plus its own: ``inputs`` (by the tab function's keyword names,
    "path" included) and ``outputs`` (by the result's field names)."""

    inputs: dict[str, Any]
    outputs: dict[str, Any]
    run: gr.Button
    message: gr.HTML
    card: gr.HTML
    stats: gr.HTML


def _tab_layout(family: str, paths: dict[str, str], intro: str, main: Callable[[str], dict[str, Any]],
                settings: Callable[[str], dict[str, Any]], advanced: Callable[[str], dict[str, Any]],
                outputs: Callable[[str], dict[str, Any]], *, wide_outputs: bool = True,
                examples: Callable[[dict[str, Any]], None] | None = None) -> _TabLayout:
    """A tab's page. Left column: ``main(elem)`` (the inputs and prompt), the Run button, ``settings(elem)``
    (the method and the few settings people change), ``examples(inputs)`` (clickable examples) and a collapsed
    "advanced settings" accordion (checkpoint path, timed repeats, ``advanced(elem)``). Right column: the
    message area, the result card and (``wide_outputs=False``) ``outputs(elem)``, then the statistics; with
    ``wide_outputs`` the outputs take the page's width under both columns. Element ids start with the family's
    name (``ar_image`` -> ``ar-image-run``, ...), which the browser tests address."""
    elem = family.replace("_", "-")
    gr.Markdown(intro, elem_classes="mmspec-intro")
    with gr.Row(equal_height=False):
        with gr.Column(scale=2):
            inputs = dict(main(elem))
            run = gr.Button("Run", variant="primary", elem_id=f"{elem}-run")
            inputs.update(settings(elem))
            if examples is not None:
                examples(inputs)
            with gr.Accordion("advanced settings", open=False, elem_id=f"{elem}-advanced"):
                inputs["path"] = _path_box(family, paths, elem)
                inputs["repeats"] = _repeats_box(elem)
                inputs.update(advanced(elem))
        with gr.Column(scale=3):
            message = gr.HTML(elem_id=f"{elem}-message")
            card = gr.HTML(elem_id=f"{elem}-card")
            shown = {} if wide_outputs else outputs(elem)
            with gr.Accordion("statistics and settings", open=True):
                stats = gr.HTML(elem_id=f"{elem}-stats")
    if wide_outputs:
        shown = outputs(elem)
    return _TabLayout(inputs, shown, run, message, card, stats)


def _generation_tab(family: str, tab: str, cache: PipelineCache, paths: dict[str, str], intro: str,
                    run: Callable[..., Any], input_names: Sequence[str], main: Callable[[str], dict[str, Any]],
                    settings: Callable[[str], dict[str, Any]], advanced: Callable[[str], dict[str, Any]],
                    outputs: Callable[[str], dict[str, Any]], example_prompts: Sequence[str],
                    label: Callable[[Any], str] | None = None) -> tuple[gr.Textbox, gr.HTML]:
    """A tab whose Run calls ``run(cache, **inputs)`` once (:func:`_handler`) and shows the result's fields
    named like the outputs, its card, its statistics and the done message (label: the method's name unless
    ``label(comparison)`` says otherwise); ``example_prompts`` are clickable examples filling the prompt."""

    def examples(inputs: dict[str, Any]) -> None:
        gr.Examples([[text] for text in example_prompts], [inputs["prompt"]], label="examples (click to use)",
                    elem_id=f"{family.replace('_', '-')}-examples")

    layout = _tab_layout(family, paths, intro, main, settings, advanced, outputs, examples=examples)
    fields = list(layout.outputs)

    def show(result: Any) -> list[Any]:
        comparison = result.comparison
        name = label(comparison) if label is not None else comparison.method
        return [*(getattr(result, field) for field in fields), result.card_html, result.stats_html,
                done_message(comparison, name)]

    _click(layout, tab, _handler(run, input_names, cache, show, len(fields) + 3, tab),
           [layout.inputs[name] for name in input_names],
           [*layout.outputs.values(), layout.card, layout.stats, layout.message])
    return layout.inputs["path"], layout.message


# ----------------------------------------------------------------------------------------------------
# tabs
# ----------------------------------------------------------------------------------------------------


def _vlm_tab(cache: PipelineCache, paths: dict[str, str]) -> tuple[gr.Textbox, gr.HTML]:
    first = next(iter(vlm_tab.EXAMPLES))
    refs: dict[str, Any] = {}

    def main(elem: str) -> dict[str, Any]:
        with gr.Row(equal_height=False):
            files = gr.File(file_count="multiple", label="upload an image (or video frames, in order)", height=110,
                            elem_id=f"{elem}-files")
            preview = gr.Gallery(vlm_tab.example_inputs(first)[0], label="input", columns=4, height=110,
                                 object_fit="contain", format="png", elem_id=f"{elem}-preview", interactive=False)
        example = gr.Radio([*vlm_tab.EXAMPLES, vlm_tab.NO_EXAMPLE], value=first, label="or click a shapes example",
                           elem_id=f"{elem}-example")
        refs["preview"] = preview
        return {"files": files, "example": example,
                "prompt": gr.Textbox(value=vlm_tab.PROMPTS["image"], label="prompt", elem_id=f"{elem}-prompt")}

    def settings(elem: str) -> dict[str, Any]:
        with gr.Row():
            method = gr.Dropdown(list(vlm_tab.METHODS), value="eagle", label="method", elem_id=f"{elem}-method")
            limit = gr.Number(value=200, precision=0, label="max new tokens", elem_id=f"{elem}-max-new-tokens")
            greedy = gr.Checkbox(value=True, label="greedy", elem_id=f"{elem}-greedy")
        refs["method"] = method
        return {"method": method, "max_new_tokens": limit, "greedy": greedy}

    def advanced(elem: str) -> dict[str, Any]:
        with gr.Row():
            fields = {"seed": gr.Number(value=0, precision=0, label="seed", elem_id=f"{elem}-seed"),
                      "temperature": gr.Number(value=1.0, label="temperature (when not greedy)",
                                               elem_id=f"{elem}-temperature"),
                      "num_draft_tokens": optional_number("K (draft tokens; FLASH: per forward)", f"{elem}-k")}
        with gr.Group() as tree_group:
            fields.update(_tree_fields(elem))
        refs["tree_group"] = tree_group
        return fields

    def outputs(elem: str) -> dict[str, Any]:
        answer = gr.HTML(vlm_tab.answer_html([]), label="speculative answer", elem_id=f"{elem}-answer")
        gr.HTML(legend_html(((DRAFT_HIGHLIGHT, "accepted draft tokens"), ((255, 255, 255), "the target's tokens"))))
        baseline = gr.Textbox(label="baseline answer (target only)", lines=3, interactive=False,
                              elem_id=f"{elem}-baseline")
        return {"answer": answer, "baseline": baseline}

    layout = _tab_layout("vlm", paths, "Image or video frames + prompt -> text. The answer streams with the accepted "
                         "draft tokens highlighted, then both sides are timed. " + ZOO_ONLY, main, settings, advanced,
                         outputs, wide_outputs=False)
    files, example, preview, message = layout.inputs["files"], layout.inputs["example"], refs["preview"], layout.message
    refs["method"].change(lambda name: gr.update(visible=name != "flash"), refs["method"], refs["tree_group"])

    def on_example(name: str, uploaded: Any) -> tuple[Any, Any]:
        if uploaded:  # uploads win over examples; keep showing them
            return gr.update(), gr.update()
        if not name or name == vlm_tab.NO_EXAMPLE:
            return None, gr.update()
        frames, text = vlm_tab.example_inputs(name)
        return frames, text

    def on_upload(uploaded: Any, name: str, path: str) -> tuple[Any, Any]:
        try:
            frames = vlm_tab.read_uploads(uploaded)
        except DemoError as error:
            return None, message_html(str(error), "error")
        if not frames:  # the upload was cleared: back to the example, and say so
            if name and name != vlm_tab.NO_EXAMPLE:
                return vlm_tab.example_inputs(name)[0], message_html(f"upload removed: the run uses {name}", "info")
            return None, message_html("upload removed: upload an image or pick a shapes example", "info")
        kind = "an image" if len(frames) == 1 else f"a video of {len(frames)} frames"
        note = f" {vlm_tab.ZOO_NOTE}" if vlm_tab.is_zoo_checkpoint(path) else ""
        return frames, message_html(f"uploaded {kind} (used instead of the example).{note}", "info")

    example.change(on_example, [example, files], [preview, layout.inputs["prompt"]])
    files.change(on_upload, [files, example, layout.inputs["path"]], [preview, message])

    def handle(*values: Any) -> Any:  # a generator: the status line is the progress indication
        kwargs = dict(zip(vlm_tab.INPUTS, values))
        try:
            with SLOT.hold("VLM"):
                for view in vlm_tab.run_vlm(cache, **kwargs):
                    if view.done:
                        yield (vlm_tab.answer_html(view.highlighted), view.baseline, view.card_html, view.stats_html,
                               done_message(view.comparison, view.comparison.method) if view.status == "done"
                               else message_html(view.status, "warn" if view.comparison.warning else "ok"))
                    else:
                        yield (vlm_tab.answer_html(view.highlighted, streaming=True), None, None, None,
                               message_html(view.status, "info"))
        except Exception as error:  # noqa: BLE001 - the page shows it; the app keeps running
            yield _error_outputs(5, error)

    _click(layout, "VLM", handle, [layout.inputs[name] for name in vlm_tab.INPUTS],
           [*layout.outputs.values(), layout.card, layout.stats, message])
    return layout.inputs["path"], message


def _ar_image_tab(cache: PipelineCache, paths: dict[str, str]) -> tuple[gr.Textbox, gr.HTML]:
    refs: dict[str, Any] = {}

    def main(elem: str) -> dict[str, Any]:
        return {"prompt": _prompt_box(elem, ar_image_tab.EXAMPLE_PROMPTS[0])}

    def settings(elem: str) -> dict[str, Any]:
        with gr.Row():
            refs["method"] = gr.Dropdown(list(ar_image_tab.METHODS), value="eagle", label="method",
                                         elem_id=f"{elem}-method")
            images = gr.Number(value=1, precision=0, label="images per prompt", elem_id=f"{elem}-num-images")
            greedy = gr.Checkbox(value=False, label="greedy", elem_id=f"{elem}-greedy")
        return {"method": refs["method"], "num_images": images, "greedy": greedy}

    def advanced(elem: str) -> dict[str, Any]:
        with gr.Row():
            fields = {"seed": gr.Number(value=0, precision=0, label="seed", elem_id=f"{elem}-seed"),
                      "temperature": gr.Number(value=1.0, label="temperature (when not greedy)",
                                               elem_id=f"{elem}-temperature"),
                      "guidance_scale": gr.Number(value=3.0, label="guidance scale", elem_id=f"{elem}-guidance")}
        # the method's settings are the checkpoint's stored ones (speculation_config.json); a field left empty
        # keeps the stored value, a value replaces it (ar_image_tab.method_config); only the active method's show
        gr.Markdown("The method's settings: empty fields keep the checkpoint's recommended values.")
        with gr.Group(visible=True) as eagle_group:
            with gr.Row():
                fields["num_draft_tokens"] = optional_number("K (draft tokens, chains)", f"{elem}-k")
                fields["lookup_tail"] = optional_number("lookup tail (free copies of the row above; 0: none)",
                                                        f"{elem}-lookup-tail")
            fields.update(_tree_fields(elem))
        with gr.Group(visible=False) as lantern_group, gr.Row():
            fields["lantern_k"] = optional_number("LANTERN k (codebook neighbours)", f"{elem}-lantern-k")
            fields["lantern_delta"] = optional_number("LANTERN delta (TV budget)", f"{elem}-lantern-delta")
            fields["lantern_lam"] = optional_number("LANTERN++ bound lam (0: use delta)", f"{elem}-lantern-lam")
            fields["argmax_drafts"] = gr.Checkbox(value=True, label="argmax drafts (sampling)",
                                                  elem_id=f"{elem}-argmax-drafts")
        with gr.Group(visible=False) as jacobi_group, gr.Row():
            fields["sjd_window"] = optional_number("Jacobi window (SJD/GSD)", f"{elem}-window")
            fields["gsd_group_size"] = optional_number("GSD group size G", f"{elem}-gsd-g")
        with gr.Group(visible=False) as mulo_group, gr.Row():
            fields["mulo_tau"] = optional_number("MuLo tau (pooled threshold)", f"{elem}-mulo-tau")
            fields["mulo_radius"] = optional_number("MuLo radius l", f"{elem}-mulo-radius")
            fields["mulo_resample"] = gr.Dropdown(
                choices=[("the checkpoint's", ar_image_tab.STORED), ("parallel (the paper's; costs quality)", "parallel"),
                         ("sequential (keeps quality, slower)", "sequential"),
                         ("reverify (raster + Jacobi passes)", "reverify")],
                value=ar_image_tab.STORED, label="MuLo resampling", elem_id=f"{elem}-mulo-resample")

        def on_method(name: str) -> list[Any]:
            return [gr.update(visible=name in ("eagle", "lantern")), gr.update(visible=name == "lantern"),
                    gr.update(visible=name in ("sjd", "gsd")), gr.update(visible=name == "mulo")]

        refs["method"].change(on_method, refs["method"], [eagle_group, lantern_group, jacobi_group, mulo_group])
        return fields

    return _generation_tab(
        "ar_image", "AR image", cache, paths, "Text-to-image with a discrete AR model (LlamaGen-style); one prompt "
        "per line makes a batch. Each row: the speculative image, its **acceptance map**, the baseline's image. "
        + ZOO_ONLY, ar_image_tab.run_ar_image, ar_image_tab.INPUTS, main, settings, advanced, _image_outputs,
        ar_image_tab.EXAMPLE_PROMPTS)


def _continuous_tab(cache: PipelineCache, paths: dict[str, str]) -> tuple[gr.Textbox, gr.HTML]:
    def main(elem: str) -> dict[str, Any]:
        return {"prompt": _prompt_box(elem, "a red circle")}

    def settings(elem: str) -> dict[str, Any]:
        with gr.Row():
            return {"method": gr.Dropdown(list(continuous_tab.METHODS), value="cspd", label="method",
                                          elem_id=f"{elem}-method"),
                    "draft_length": optional_number("CSpD gamma (draft iterations per target pass)", f"{elem}-gamma"),
                    "num_images": gr.Number(value=2, precision=0, label="images per prompt", elem_id=f"{elem}-batch")}

    def advanced(elem: str) -> dict[str, Any]:
        with gr.Row():
            fields = {"seed": gr.Number(value=0, precision=0, label="seed", elem_id=f"{elem}-seed"),
                      "num_iter": gr.Number(value=0, precision=0, label="MAR iterations (0: one token each)",
                                            elem_id=f"{elem}-num-iter"),
                      "temperature": gr.Number(value=1.0, label="temperature", elem_id=f"{elem}-temperature"),
                      "guidance_scale": gr.Number(value=1.0, label="guidance scale", elem_id=f"{elem}-guidance")}
        with gr.Row():
            fields["verify_order"] = gr.Dropdown([("the checkpoint's", continuous_tab.STORED),
                                                  *continuous_tab.VERIFY_ORDERS],
                                                 value=continuous_tab.STORED, label="verification order")
            fields["verify_context"] = gr.Dropdown([("the checkpoint's", continuous_tab.STORED),
                                                    *continuous_tab.VERIFY_CONTEXTS],
                                                   value=continuous_tab.STORED, label="target context")
        return fields

    return _generation_tab(
        "continuous", "Continuous AR image", cache, paths, "Text-to-image with a MAR-style model over **continuous** "
        "tokens; CSpD drafts gamma MAR iterations with a small MAR and verifies them in one target pass. Class-"
        "conditioned checkpoints take class ids (one per line). " + ZOO_ONLY, continuous_tab.run_continuous,
        continuous_tab.INPUTS, main, settings, advanced, _image_outputs,
        ("a red circle", "a blue square and a green triangle", "two diamonds"), label=lambda comparison: "CSpD")


def _video_tab(cache: PipelineCache, paths: dict[str, str]) -> tuple[gr.Textbox, gr.HTML]:
    refs: dict[str, Any] = {}

    def main(elem: str) -> dict[str, Any]:
        return {"prompt": _prompt_box(elem, video_tab.EXAMPLE_PROMPTS[0])}

    def settings(elem: str) -> dict[str, Any]:
        with gr.Row():
            refs["method"] = gr.Dropdown(list(video_tab.METHODS), value="sdvg", label="method",
                                         elem_id=f"{elem}-method")
            videos = gr.Number(value=1, precision=0, label="videos per prompt", elem_id=f"{elem}-videos")
            refs["tau"] = optional_number("tau (reward threshold)", f"{elem}-tau")
        return {"method": refs["method"], "num_videos": videos, "tau": refs["tau"]}

    def advanced(elem: str) -> dict[str, Any]:
        with gr.Row():
            fields = {"seed": gr.Number(value=0, precision=0, label="seed", elem_id=f"{elem}-seed"),
                      "num_blocks": gr.Number(value=0, precision=0, label="blocks (0: all)",
                                              elem_id=f"{elem}-num-blocks"),
                      "num_inference_steps": gr.Number(value=4, precision=0, label="denoising steps per block",
                                                       elem_id=f"{elem}-steps"),
                      # the zoo's pair draws the prompt in far more frames with guidance 3 (docs/pipeline_video.md)
                      "guidance_scale": gr.Number(value=3.0, label="guidance scale", elem_id=f"{elem}-guidance")}
        with gr.Group() as sdvg_group:
            with gr.Row():
                fields["reward"] = gr.Dropdown([("the checkpoint's", video_tab.STORED), *video_tab.REWARDS],
                                               value=video_tab.STORED, label="reward", elem_id=f"{elem}-reward")
                fields["aggregate"] = gr.Dropdown([("the checkpoint's", video_tab.STORED), *video_tab.AGGREGATES],
                                                  value=video_tab.STORED, label="aggregate over frames")
                fields["force_reject_first"] = gr.Dropdown(
                    [("the checkpoint's", video_tab.STORED), *video_tab.FIRST_BLOCK], value=video_tab.STORED,
                    label="first block always by the target", elem_id=f"{elem}-first")
            fields["reward_weights"] = gr.Textbox(
                value="", label="reward weights (ImageReward: a folder with ImageReward.pt, med_config.json, "
                "tokenizer/; CLIP: MODEL:FILE; shapes: none)", elem_id=f"{elem}-reward-weights")
            fields["refine_rejected_from"] = optional_number(
                "target refines rejected drafts from timestep (0: redraws them from noise)", f"{elem}-refine")

        def on_method(name: str) -> list[Any]:
            return [gr.update(visible=name == "sdvg"), gr.update(visible=name == "sdvg")]

        refs["method"].change(on_method, refs["method"], [sdvg_group, refs["tau"]])
        return fields

    def outputs(elem: str) -> dict[str, Any]:
        def animated(label: str, elem_id: str) -> gr.Image:
            # a .gif path: the browser plays it (type="pil" would keep only its first frame)
            return gr.Image(label=label, type="filepath", interactive=False, elem_id=elem_id,
                            buttons=["download", "fullscreen"], height=300)

        gr.HTML(legend_html(video_tab.STRIP_LEGEND))
        with gr.Row(equal_height=False):
            spec_animation = animated("speculative, playing", f"{elem}-animation")
            base_animation = animated("baseline (target only, same seed), playing", f"{elem}-baseline-animation")
        gr.Markdown("**Speculative: every frame** (the bar under each block says who made it)")
        spec_strip = gr.Image(type="pil", format="png", interactive=False, elem_id=f"{elem}-strip", show_label=False)
        blocks_html = gr.HTML(elem_id=f"{elem}-block-strip")
        gr.Markdown("**Baseline (target only, same seed): every frame**")
        base_strip = gr.Image(type="pil", format="png", interactive=False, elem_id=f"{elem}-baseline",
                              show_label=False)
        return {"spec_animation": spec_animation, "base_animation": base_animation, "spec_strip": spec_strip,
                "blocks_html": blocks_html, "base_strip": base_strip}

    return _generation_tab(
        "video", "AR video", cache, paths, "Text-to-video with a block-causal AR video model. SDVG: the drafter "
        "proposes each block, a reward scores its frames, blocks scoring >= tau are kept, the target regenerates "
        f"the others; `draft`: the drafter alone. The clips loop at {video_tab.ANIMATION_FPS} fps. " + ZOO_ONLY,
        video_tab.run_video, video_tab.INPUTS, main, settings, advanced, outputs, video_tab.EXAMPLE_PROMPTS)


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
        gr.Markdown(INTRO, elem_classes="mmspec-intro")
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


def preload(paths: dict[str, str], cache: PipelineCache, say: Callable[[str], None] = print) -> None:
    """Load every tab's checkpoint now (``say`` reports each), so the first Run does not wait for it; a
    checkpoint that fails to load is reported and left to its tab's message."""
    for family in FAMILIES:
        path = paths.get(family, FAMILIES[family][2])
        say(f"loading {family} from {path} ...")
        try:
            cache.get(family, path)
        except Exception as error:  # noqa: BLE001 - the tab shows the same message when it runs
            say(f"  not loaded: {user_message(error)}")


def launch(paths: dict[str, str] | None = None, host: str = "127.0.0.1", port: int | None = 7860, *,
           block: bool = True, quiet: bool = False, cache: PipelineCache | None = None,
           load_models: bool = True) -> tuple[gr.Blocks, str]:
    """Build and serve the page on ``host:port`` (127.0.0.1 by default: not reachable from other machines).
    ``block=False`` returns right after start-up (tests); ``cache``: where and how pipelines load (device,
    precision; default: the machine's default device); ``load_models``: load every tab's checkpoint before
    serving (:func:`preload`; progress printed unless ``quiet``). The page is served with one generation
    queue for all tabs. Returns ``(app, local url)``."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    say = (lambda text: None) if quiet else (lambda text: print(text, flush=True))
    say("loading models (pipeline modules first) ...")
    demo = build_app(paths, cache)
    if load_models:
        preload(dict(paths or {}), demo.mmspec_cache, say)
    demo.queue(default_concurrency_limit=1)
    _, url, _ = demo.launch(server_name=host, server_port=port, prevent_thread_lock=not block, quiet=quiet,
                            css=CSS, show_error=True, footer_links=[], ssr_mode=False)
    return demo, url
