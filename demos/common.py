"""What every tab of the demo shares: loading pipelines by path (cached), checking the page's inputs,
running the speculative method and the target-only baseline on the same inputs and seed, and showing
the statistics and acceptance maps.

Nothing here imports gradio: the tab functions (``mmspec.demos.vlm_tab`` etc.) are plain Python, tested
without a browser; only :mod:`mmspec.demos.app` builds the page.
"""

from __future__ import annotations

import html
import importlib
import math
import statistics
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import PIL.Image
import torch

from mmspec.demos.timing import DEFAULT_REPEATS, Comparison, Report, compare, speed_words
from mmspec.devices import load_pipeline

#: family -> (module, pipeline class, default zoo id)
FAMILIES: dict[str, tuple[str, str, str]] = {
    "vlm": ("mmspec.pipelines.vlm", "VLMPipeline", "mmspec/shapes-vlm"),
    "ar_image": ("mmspec.pipelines.ar_image", "ARImagePipeline", "mmspec/shapes-t2i"),
    "continuous": ("mmspec.pipelines.continuous_ar_image", "ContinuousARImagePipeline", "mmspec/shapes-t2i-continuous"),
    "video": ("mmspec.pipelines.ar_video", "ARVideoPipeline", "mmspec/shapes-video"),
}

#: colours of the acceptance maps and strips (RGB): drafted-and-accepted vs target-produced
DRAFT_COLOR = (236, 72, 153)    # magenta
TARGET_COLOR = (56, 189, 248)   # sky blue
REJECT_COLOR = (249, 115, 22)   # orange: a drafted block the router rejected (video)
MAX_SEED = 2**31 - 1


class DemoError(Exception):
    """A problem with what the user entered (or with the checkpoint they named): the page shows the
    message instead of a result; the app keeps running."""


def user_message(error: BaseException) -> str:
    """The text the page shows for an error of a run: the message of input errors (``DemoError``, the
    pipelines' ``ValueError`` / ``FileNotFoundError`` / ``NotImplementedError`` / ``KeyError``), as written,
    without the exception's class name; for anything unexpected a one-line summary (the server logs the
    traceback)."""
    if isinstance(error, DemoError):
        return str(error)
    if isinstance(error, KeyError):
        return str(error).strip("'\"")
    if isinstance(error, (ValueError, FileNotFoundError, NotImplementedError)):
        return str(error)
    return f"the run failed unexpectedly ({error}); the server log has the details"


# ----------------------------------------------------------------------------------------------------
# input checks
# ----------------------------------------------------------------------------------------------------

#: a page choice that keeps the checkpoint's stored method setting
STORED = "checkpoint"


def given(value: Any) -> Any:
    """A method knob's value, or None when the page left it at the checkpoint's setting (an empty text field
    sends "", a choice :data:`STORED`)."""
    if value is None or (isinstance(value, str) and (not value.strip() or value == STORED)):
        return None
    return value


def _parse_number(name: str, value: Any, expected: str) -> float:
    """``value`` as a float, or a :class:`DemoError` naming the field and what it takes (``expected``, e.g.
    "an integer in [1, 8]") when it is empty or not a number."""
    if value is None or value == "" or isinstance(value, bool):
        raise DemoError(f"{name} is empty: enter {expected}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise DemoError(f"{name} must be {expected}, got {value!r}") from None


def check_int(name: str, value: Any, low: int, high: int) -> int:
    """``value`` as an integer in ``[low, high]`` or a :class:`DemoError` naming the field."""
    expected = f"an integer in [{low}, {high}]"
    number = _parse_number(name, value, expected)
    if not math.isfinite(number) or number != int(number) or not low <= int(number) <= high:
        raise DemoError(f"{name} must be {expected}, got {value!r}")
    return int(number)


def check_float(name: str, value: Any, low: float, high: float, *, low_open: bool = False,
                allow_inf: bool = False) -> float:
    """``value`` as a number in ``[low, high]`` (``(low, high]`` with ``low_open``) or a :class:`DemoError`.
    ``allow_inf`` also accepts -inf / +inf (typed as "inf" / "-inf")."""
    expected = f"a number in {'(' if low_open else '['}{low}, {high}]"
    number = _parse_number(name, value, expected)
    if math.isnan(number):
        raise DemoError(f"{name} must be a number, got NaN")
    if math.isinf(number) and allow_inf:
        return number
    if not (low < number if low_open else low <= number) or not number <= high:
        raise DemoError(f"{name} must be {expected}, got {value!r}")
    return number


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    if value not in choices:
        raise DemoError(f"{name} must be one of {list(choices)}, got {value!r}")
    return str(value)


def parse_prompts(text: Any, max_prompts: int = 8) -> list[str]:
    """One prompt per non-empty line of ``text`` (a batch), at most ``max_prompts``."""
    if not isinstance(text, str) or not text.strip():
        raise DemoError("prompt is empty: type a prompt (one per line for a batch)")
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if len(prompts) > max_prompts:
        raise DemoError(f"at most {max_prompts} prompts (one per line) per run, got {len(prompts)}")
    return prompts


MAX_BATCH = 16


def check_batch(num_prompts: int, per_prompt: int, what: str = "images") -> int:
    """Rows of a run (prompts x outputs per prompt), at most :data:`MAX_BATCH` (the page shows them all)."""
    rows = num_prompts * per_prompt
    if rows > MAX_BATCH:
        raise DemoError(f"at most {MAX_BATCH} {what} per run (prompts x {what} per prompt), got {num_prompts} x "
                        f"{per_prompt} = {rows}")
    return rows


class Request(NamedTuple):
    """The inputs every generation tab takes, checked: the method, the prompts (one per line), outputs
    per prompt and the seed (unpacks as ``method, prompts, per_prompt, seed``)."""

    method: str
    prompts: list[str]
    per_prompt: int
    seed: int


def check_request(method: Any, methods: Sequence[str], prompt: Any, per_prompt: Any, seed: Any, *,
                  per_prompt_name: str, max_per_prompt: int, what: str) -> Request:
    """Check the inputs every generation tab shares, in the same order in every tab: ``method`` (one of
    ``methods``), the prompts, ``per_prompt`` (the field ``per_prompt_name``, in ``[1, max_per_prompt]``; at
    most :data:`MAX_BATCH` ``what`` in all) and ``seed``."""
    method = check_choice("method", method, methods)
    prompts = parse_prompts(prompt)
    count = check_int(per_prompt_name, per_prompt, 1, max_per_prompt)
    check_batch(len(prompts), count, what)
    return Request(method, prompts, count, check_int("seed", seed, 0, MAX_SEED))


def sampling_kwargs(greedy: bool, temperature: Any) -> dict[str, Any]:
    """The pipelines' sampling arguments from the page's greedy box and temperature field: ``do_sample``,
    plus the checked ``temperature`` when sampling (the field is ignored for greedy runs)."""
    kwargs: dict[str, Any] = {"do_sample": not greedy}
    if not greedy:
        kwargs["temperature"] = check_float("temperature", temperature, 0.0, 5.0, low_open=True)
    return kwargs


def tree_config(tree_depth: Any, tree_top_k: Any, tree_total_tokens: Any) -> Any:
    """An EAGLE-2 dynamic draft tree (:class:`~mmspec.drafters.TreeConfig`) from the page's tree fields."""
    from mmspec import TreeConfig

    return TreeConfig(depth=check_int("tree depth", tree_depth, 1, 12),
                      top_k=check_int("tree top-k", tree_top_k, 1, 16),
                      total_tokens=check_int("tree total tokens", tree_total_tokens, 1, 128))


# ----------------------------------------------------------------------------------------------------
# pipelines by path, cached
# ----------------------------------------------------------------------------------------------------


def resolve_checkpoint(family: str, path: Any) -> str:
    """The folder a tab loads: a zoo id (``mmspec/...``, resolved offline) or a saved pipeline folder.

    Raises :class:`DemoError` for an empty field, a path that does not exist, a folder without
    ``model_index.json``, and the zoo's own ``FileNotFoundError`` message for an entry not built yet.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {list(FAMILIES)}, got {family!r}")
    text = path.strip() if isinstance(path, str) else ""
    if not text:
        raise DemoError(f"checkpoint path is empty: give a saved pipeline folder or a zoo id such as "
                        f"{FAMILIES[family][2]}")
    if text.startswith("mmspec/"):
        from mmspec.pipelines.hub import resolve_pretrained

        try:
            return resolve_pretrained(text)
        except FileNotFoundError as error:
            raise DemoError(str(error)) from None
    folder = Path(text).expanduser()
    if not folder.exists():
        raise DemoError(f"checkpoint path {text!r} does not exist: give a saved pipeline folder (with "
                        f"model_index.json) or a zoo id such as {FAMILIES[family][2]}")
    if not (folder / "model_index.json").is_file():
        raise DemoError(f"checkpoint path {text!r} is not a saved pipeline folder: it has no model_index.json "
                        "(write one with the pipeline's save_pretrained)")
    return str(folder.resolve())


def import_pipeline_modules() -> None:
    """Import every family's pipeline module (and with it diffusers and transformers) now, in the calling
    thread. The page's handlers run in worker threads, several at once when the page loads (one checkpoint
    check per tab); transformers' lazy module loader is not safe against concurrent first imports and
    failed once with "Could not import module 'PreTrainedModel'". Call this from the thread that builds
    the app."""
    for module, _, _ in FAMILIES.values():
        importlib.import_module(module)


#: pipeline class -> the tab that runs it (for a folder given to the wrong tab)
TAB_NAMES = {"VLMPipeline": "VLM", "ARImagePipeline": "AR image", "ContinuousARImagePipeline": "Continuous AR image",
             "ARVideoPipeline": "AR video"}


def with_article(word: str) -> str:
    """``word`` after "a" or "an" as it is read aloud ("an ARImagePipeline", "a VLMPipeline")."""
    spoken_vowel = word[:1].lower() in "aeio" or (word[:2].isupper() and word[:1] in "AEFHILMNORSX")
    return f"{'an' if spoken_vowel else 'a'} {word}"


def check_family(family: str, folder: str) -> None:
    """A :class:`DemoError` when the pipeline folder ``folder`` holds another family's pipeline, naming the
    tab that runs it."""
    import json

    try:
        held = json.loads((Path(folder) / "model_index.json").read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return  # the loader reports a broken model_index.json with its own message
    expected = FAMILIES[family][1]
    if isinstance(held, str) and held != expected:
        where = f": use it in the {TAB_NAMES[held]} tab" if held in TAB_NAMES else ""
        raise DemoError(f"{folder} holds {with_article(held)}, not {with_article(expected)}{where}")


class PipelineCache:
    """Pipelines loaded once per (family, folder) and kept for the app's lifetime; thread-safe. Each loads on
    ``device`` (None: CUDA when torch sees a GPU, else the CPU) in ``dtype`` (None: the checkpoint's compute
    precision) with the CPU GEMM mode ``cpu_gemm`` (:mod:`mmspec.cpu_gemm`; "plain" unless asked for).

    ``warm_up(pipe, key, fn)`` runs ``fn`` once per key (untimed) before the first timed comparison, so
    one-off costs (first forward passes, lazy initialisation) do not land in either run's wall time.
    """

    def __init__(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 cpu_gemm: str = "plain") -> None:
        self.device, self.dtype, self.cpu_gemm = device, dtype, cpu_gemm  # as `mmspec demo --device/--dtype/--cpu-gemm`
        self._pipes: dict[tuple[str, str], Any] = {}
        self._warm: set[tuple[int, Any]] = set()
        self._lock = threading.Lock()

    def get(self, family: str, path: Any) -> Any:
        """The pipeline of ``family`` saved at ``path`` (loaded on first use); a :class:`DemoError` for a path
        that is not a pipeline folder, a folder of another family, or one that fails to load."""
        folder = resolve_checkpoint(family, path)
        key = (family, folder)
        with self._lock:
            if key not in self._pipes:
                module, name, _ = FAMILIES[family]
                check_family(family, folder)
                cls = getattr(importlib.import_module(module), name)
                try:
                    pipe = load_pipeline(cls, folder, device=self.device, dtype=self.dtype)
                except (ValueError, OSError, KeyError, TypeError) as error:
                    raise DemoError(f"could not load {with_article(name)} from {folder}: {error}") from None
                pipe.set_progress_bar_config(disable=True)
                pipe.set_cpu_gemm(self.cpu_gemm)
                self._pipes[key] = pipe
            return self._pipes[key]

    def warm_up(self, pipe: Any, key: Any, fn: Callable[[], Any]) -> bool:
        """Run ``fn`` once for ``(pipe, key)``; returns whether it ran now."""
        token = (id(pipe), key)
        if token in self._warm:
            return False
        fn()
        self._warm.add(token)
        return True

    def __len__(self) -> int:
        return len(self._pipes)


# ----------------------------------------------------------------------------------------------------
# speculative run vs baseline
# ----------------------------------------------------------------------------------------------------


def warm_up_and_compare(cache: PipelineCache, pipe: Any, family: str, run: Callable[..., Any], method: str,
                        seed: int, *, warm_output_type: str, repeats: int = DEFAULT_REPEATS,
                        report: Report | None = None) -> Comparison:
    """:func:`~mmspec.demos.timing.compare` (the CLI's protocol: a warm-up call each, then ``repeats``
    alternating timed calls) after a one-off call of ``method`` and of ``"none"`` the first time this
    pipeline runs them in this process (``run(name, None, no progress, warm_output_type)``, see
    :meth:`PipelineCache.warm_up`): lazy initialisation stays out of the protocol's own warm-up.
    ``warm_output_type`` should skip decoding ("tokens", "latent")."""
    for name in (method, "none"):
        cache.warm_up(pipe, (family, name), lambda name=name: run(name, None, lambda fraction: None, warm_output_type))
    return compare(run, method, seed, repeats=repeats, report=report)


def _fmt(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def stats_html(comparison: Comparison, *, show_accepted_length: bool = True, unit: str = "tokens") -> str:
    """The statistics panel: median wall time and its range, speedup, mean accepted length and calls of both
    sides."""
    spec, base = comparison.speculative.stats, comparison.baseline.stats
    low, high = comparison.speedup_range

    def seconds(times: list[float]) -> str:
        return f"{statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f})"

    rows: list[tuple[str, str, str]] = [
        (f"wall time, s (median of {comparison.repeats}; range)", seconds(comparison.spec_times),
         seconds(comparison.base_times)),
        ("speedup (range over the passes)", f"{_fmt(comparison.speedup)}x ({_fmt(low)}-{_fmt(high)}x)", "1.00x"),
    ]
    if show_accepted_length:
        rows.append(("mean accepted length", _fmt(spec.mean_accepted_length), _fmt(base.mean_accepted_length)))
    rows += [("target calls", str(spec.target_calls), str(base.target_calls)),
             ("draft calls", str(spec.draft_calls), str(base.draft_calls)),
             (unit, str(spec.tokens), str(base.tokens))]
    rows += [(name, a, b) for name, (a, b) in comparison.extra.items()]
    body = "".join(f"<tr><th>{html.escape(name)}</th><td>{html.escape(a)}</td><td>{html.escape(b)}</td></tr>"
                   for name, a, b in rows)
    notes = "".join(f"<li>{html.escape(note)}</li>" for note in comparison.notes)
    return (f"<div class='mmspec-stats'><table><thead><tr><th></th><th>speculative ({html.escape(comparison.method)})"
            f"</th><th>baseline (target only)</th></tr></thead><tbody>{body}</tbody></table>"
            f"<ul class='mmspec-notes'>{notes}</ul></div>")


def headline_html(comparison: Comparison, *, identical: bool | None = None) -> str:
    """The result card: the speedup in words with its range, the target calls of both sides, and what the
    output is worth: "identical to the baseline" (``identical``) or the lossless note for a lossless method,
    the quality figure (:attr:`Comparison.quality`) for a lossy one. A speedup the call counts contradict
    (:attr:`Comparison.warning`) makes a warning card, never a green one."""
    spec, base = comparison.speculative.stats, comparison.baseline.stats
    low, high = comparison.speedup_range
    words = speed_words(comparison.speedup)
    name = comparison.method
    lines = [f"range {_fmt(low)}-{_fmt(high)}x over {comparison.repeats} alternating timed runs per side, after a "
             f"warm-up; median {comparison.spec_seconds:.2f} s against {comparison.base_seconds:.2f} s",
             f"target calls: {spec.target_calls} against {base.target_calls}"
             + ("" if comparison.ideal_speedup is None else
                f" (step compression {comparison.ideal_speedup:.2f}x: tokens per target call over the baseline's)")]
    if comparison.lossless:
        if identical:
            lines.append("output identical to the baseline (lossless)")
        else:
            lines.append("lossless: the same distribution as the baseline (sampled runs use the random numbers "
                         "differently, so the outputs differ)")
    elif comparison.quality is not None:
        what, ours, theirs = comparison.quality
        lines.append(f"lossy: {what} {ours} against the baseline's {theirs}")
    else:
        lines.append("lossy: no quality figure for these inputs; compare the outputs below")
    if comparison.noisy:
        lines.append("the passes disagree by more than 25%: the machine was busy; the median is shown")
    if comparison.contended:
        lines.append(f"contended machine: {comparison.load.describe()}; other work slows every forward and "
                     "overstates the speedup")
    warning = comparison.warning
    if warning is not None:
        kind, title = "warn", f"{name}: timing not trusted"
        lines.insert(0, warning)
    else:
        # amber when the timing is doubtful (a busy machine, passes that disagree), never green
        kind = "warn" if comparison.contended or comparison.noisy else "ok" if comparison.speedup >= 1 else "slow"
        title = f"{name}: {words} the baseline"
    items = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
    return (f"<div class='mmspec-card mmspec-card-{kind}'><div class='mmspec-card-title'>{html.escape(title)}</div>"
            f"<ul>{items}</ul></div>")


CPU_NOTE = ("Timing: one warm-up call per side, then alternating timed calls (baseline, method, ...), same inputs "
            "and seed, one run at a time in the whole app; the speedup is the ratio of the medians. On a CPU at "
            "the zoo's sizes a forward over a round's several tokens costs more than a one-token forward and "
            "drafting costs time, so the speedup stays below the accepted length; absolute times are not GPU "
            "times, and a busy machine makes every figure unreliable.")
LENGTH_NOTE = "Mean accepted length: tokens gained per target verification call, the bonus token included."


# ----------------------------------------------------------------------------------------------------
# images
# ----------------------------------------------------------------------------------------------------


def to_pil_list(images: Any) -> list[PIL.Image.Image]:
    """PIL RGB images from a PIL list, an array ``[B, H, W, 3]`` in [0, 1] or a tensor ``[B, 3, H, W]``."""
    if isinstance(images, torch.Tensor):
        images = images.detach().float().permute(0, 2, 3, 1).cpu().numpy()
    if isinstance(images, np.ndarray):
        return [PIL.Image.fromarray((np.clip(im, 0, 1) * 255 + 0.5).astype(np.uint8)) for im in images]
    return [im.convert("RGB") for im in images]


def upscale(image: PIL.Image.Image, size: int = 384) -> PIL.Image.Image:
    """``image`` with its longer side at ``size`` pixels: nearest neighbour when that is an integer factor
    (the zoo's tiny images stay crisp), else Lanczos."""
    longest = max(image.size)
    if longest == size:
        return image
    scale = size / longest
    target = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    exact = size % longest == 0
    return image.resize(target, PIL.Image.NEAREST if exact else PIL.Image.LANCZOS)


def acceptance_overlay(image: PIL.Image.Image, drafted: torch.Tensor | np.ndarray, size: int = 384) -> PIL.Image.Image:
    """The per-token acceptance map of an image, as large as the image shown beside it: each token's cell
    in exactly the legend's colour (:data:`DRAFT_COLOR`: drafted and accepted, :data:`TARGET_COLOR`: produced
    by the target), with thin darker lines between cells. ``drafted`` is bool ``[h, w]`` (one entry per token
    of the image's grid)."""
    mask = np.asarray(drafted.cpu() if isinstance(drafted, torch.Tensor) else drafted, dtype=bool)
    if mask.ndim != 2:
        raise ValueError(f"drafted must be [h, w], got shape {mask.shape}")
    width, height = upscale(image, size).size
    rows = np.minimum(np.arange(height) * mask.shape[0] // height, mask.shape[0] - 1)
    cols = np.minimum(np.arange(width) * mask.shape[1] // width, mask.shape[1] - 1)
    full = mask[rows][:, cols]
    pixels = np.where(full[..., None], np.asarray(DRAFT_COLOR, np.uint8), np.asarray(TARGET_COLOR, np.uint8))
    if height // mask.shape[0] >= 6 and width // mask.shape[1] >= 6:  # lines between tokens
        edges_y = np.flatnonzero(np.diff(rows)) + 1
        edges_x = np.flatnonzero(np.diff(cols)) + 1
        pixels[edges_y] = (pixels[edges_y] * 0.7).astype(np.uint8)
        pixels[:, edges_x] = (pixels[:, edges_x] * 0.7).astype(np.uint8)
    return PIL.Image.fromarray(pixels)


def legend_html(items: Sequence[tuple[tuple[int, int, int], str]]) -> str:
    """A small colour legend."""
    spans = "".join(f"<span class='mmspec-legend-item'><span class='mmspec-swatch' style='background:rgb{color}'>"
                    f"</span>{html.escape(text)}</span>" for color, text in items)
    return f"<div class='mmspec-legend'>{spans}</div>"


MAP_LEGEND = ((DRAFT_COLOR, "drafted and accepted"), (TARGET_COLOR, "produced by the target"))
LABEL_SIZE = 18  # font size of the labels drawn into pictures (pixels)


def label_band(text: str, width: int, size: int = LABEL_SIZE) -> PIL.Image.Image:
    """A white band ``width`` pixels wide with ``text`` in dark grey (cut with "..." when too long)."""
    from PIL import ImageDraw, ImageFont

    font = ImageFont.load_default(size=size)
    band = PIL.Image.new("RGB", (width, size + 10), (255, 255, 255))
    draw = ImageDraw.Draw(band)
    while text and draw.textlength(text, font=font) > width - 8:
        text = text[:-4] + "..." if len(text) > 4 else ""
    draw.text((4, 4), text, fill=(39, 39, 42), font=font)
    return band


def panel(rows: Sequence[Sequence[PIL.Image.Image]], gap: int = 8, labels: Sequence[str] | None = None,
          headers: Sequence[str] | None = None) -> PIL.Image.Image:
    """Tiles of equal size in rows (white gaps between them): one picture for the page. ``labels``: a line
    of text above each row (e.g. its prompt); ``headers``: a line above each column, once at the top."""
    height, width = rows[0][0].height, rows[0][0].width
    columns = max(len(row) for row in rows)
    full_width = columns * width + (columns - 1) * gap
    blocks: list[list[PIL.Image.Image]] = []  # white gaps go between blocks
    if headers:
        head = PIL.Image.new("RGB", (full_width, LABEL_SIZE + 10), (255, 255, 255))
        for c, text in enumerate(headers):
            head.paste(label_band(text, width), (c * (width + gap), 0))
        blocks.append([head])
    for r, row in enumerate(rows):
        line = PIL.Image.new("RGB", (full_width, height), (255, 255, 255))
        for c, tile in enumerate(row):
            line.paste(tile.convert("RGB").resize((width, height), PIL.Image.NEAREST), (c * (width + gap), 0))
        blocks.append([label_band(labels[r], full_width), line] if labels else [line])
    if headers and labels:  # the first row's label sits right under the headers
        blocks[:2] = [blocks[0] + blocks[1]]
    heights = [sum(part.height for part in block) for block in blocks]
    canvas = PIL.Image.new("RGB", (full_width, sum(heights) + gap * (len(blocks) - 1)), (255, 255, 255))
    top = 0
    for block in blocks:
        for part in block:
            canvas.paste(part, (0, top))
            top += part.height
        top += gap
    return canvas


def image_panel(comparison: Comparison, labels: Sequence[str] | None = None, size: int = 384) -> PIL.Image.Image:
    """The picture of an image comparison: one row per image (speculative image, its acceptance map, the
    baseline's image of the same row and seed), its prompt above it, column headers on top."""
    spec = comparison.speculative
    spec_images, base_images = to_pil_list(spec.images), to_pil_list(comparison.baseline.images)
    rows = [[upscale(image, size), acceptance_overlay(image, spec.drafted[i], size), upscale(base_images[i], size)]
            for i, image in enumerate(spec_images)]
    labels = list(labels) if labels is not None else [f"image {i}" for i in range(len(rows))]
    return panel(rows, labels=labels, headers=(f"speculative ({comparison.method})", "acceptance map",
                                               "baseline (target only)"))


def world_prompt(text: str) -> Any:
    """The shapes world's evaluation prompt whose text is ``text`` (casing and a final "." ignored), or None
    when the world's evaluator does not know it."""
    from mmspec.world.prompts import CATEGORIES, enumerate_prompts

    global _WORLD_PROMPTS
    if _WORLD_PROMPTS is None:
        _WORLD_PROMPTS = {p.text: p for category in CATEGORIES for p in enumerate_prompts(category)}
    return _WORLD_PROMPTS.get(text.strip().rstrip(".").strip().lower())


_WORLD_PROMPTS: dict[str, Any] | None = None


def prompt_match_quality(spec_images: Sequence[PIL.Image.Image], base_images: Sequence[PIL.Image.Image],
                         prompts: Sequence[str]) -> tuple[str, str, str] | None:
    """The quality figure of a lossy image method: how many images of each side show what their prompt asks
    for, by the shapes world's exact evaluator (``(what, speculative "k of n", baseline "k of n")``), or
    None when a prompt is not one of the world's (the evaluator cannot judge it)."""
    from mmspec.world.evaluator import score_image

    specs = [world_prompt(text) for text in prompts]
    if not specs or any(spec is None for spec in specs):
        return None
    ours = sum(score_image(np.asarray(image), spec) for image, spec in zip(spec_images, specs))
    theirs = sum(score_image(np.asarray(image), spec) for image, spec in zip(base_images, specs))
    return "images showing their prompt (the shapes world's exact check)", f"{ours} of {len(specs)}", \
        f"{theirs} of {len(specs)}"


@dataclass
class ImageResult:
    """What an image tab shows: one picture with a row per image (speculative image, acceptance map,
    baseline image, the prompt above), the result card, the statistics panel, and the comparison itself."""

    gallery: PIL.Image.Image
    card_html: str
    stats_html: str
    comparison: Comparison

    @classmethod
    def from_comparison(cls, comparison: Comparison, labels: Sequence[str] | None = None,
                        identical: bool | None = None) -> ImageResult:
        """The picture (:func:`image_panel`, rows labelled with ``labels``: each image's prompt), the card
        (:func:`headline_html`; a lossy comparison without a quality figure gets the prompt check of
        :func:`prompt_match_quality` when ``labels`` are the world's prompts) and statistics."""
        if labels is not None and not comparison.lossless and comparison.quality is None:
            comparison.quality = prompt_match_quality(to_pil_list(comparison.speculative.images),
                                                      to_pil_list(comparison.baseline.images), labels)
        return cls(image_panel(comparison, labels), headline_html(comparison, identical=identical),
                   stats_html(comparison), comparison)
