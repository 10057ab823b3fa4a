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
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import PIL.Image
import torch

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
    pipelines' ``ValueError`` / ``FileNotFoundError`` / ``NotImplementedError``), a one-line summary for
    anything unexpected."""
    if isinstance(error, DemoError):
        return str(error)
    if isinstance(error, (ValueError, FileNotFoundError, NotImplementedError, KeyError)):
        text = str(error).strip("'\"") if isinstance(error, KeyError) else str(error)
        return f"{type(error).__name__}: {text}"
    return f"the run failed ({type(error).__name__}: {error})"


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


def seeded(seed: int) -> torch.Generator:
    """The generator of one run: both runs of a comparison get a fresh one from the same seed."""
    return torch.Generator().manual_seed(int(seed))


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
            raise DemoError(f"FileNotFoundError: {error}") from None
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
        folder = resolve_checkpoint(family, path)
        key = (family, folder)
        with self._lock:
            if key not in self._pipes:
                module, name, _ = FAMILIES[family]
                cls = getattr(importlib.import_module(module), name)
                try:
                    pipe = load_pipeline(cls, folder, device=self.device, dtype=self.dtype)
                except (ValueError, OSError, KeyError, TypeError) as error:
                    raise DemoError(f"could not load a {name} from {folder}: {type(error).__name__}: {error}"
                                    ) from None
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


@dataclass
class Comparison:
    """The speculative run and the target-only baseline of one request (same inputs, same seed).

    Attributes:
        method: the speculative method's name.
        speculative / baseline: the pipeline outputs (each with ``stats``).
        spec_seconds / base_seconds: wall time of each call, end to end (decoding included).
        notes: extra lines for the statistics panel.
        extra: extra statistics rows ``name -> (speculative value, baseline value)`` (strings).
    """

    method: str
    speculative: Any
    baseline: Any
    spec_seconds: float
    base_seconds: float
    notes: list[str] = field(default_factory=list)
    extra: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return self.base_seconds / self.spec_seconds if self.spec_seconds > 0 else float("nan")

    def summary(self) -> dict[str, Any]:
        """The numbers the page shows (also what tests read)."""
        spec, base = self.speculative.stats, self.baseline.stats
        return {"method": self.method, "spec_seconds": self.spec_seconds, "base_seconds": self.base_seconds,
                "speedup": self.speedup, "mean_accepted_length": spec.mean_accepted_length,
                "base_mean_accepted_length": base.mean_accepted_length, "target_calls": spec.target_calls,
                "base_target_calls": base.target_calls, "draft_calls": spec.draft_calls}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``(fn(), seconds)``."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


Report = Callable[[float, str], None]


def compare(run: Callable[[str, torch.Generator, Callable[[float], None]], Any], method: str, seed: int, *,
            report: Report | None = None) -> Comparison:
    """Run ``method`` then the baseline ``"none"`` through ``run(method, generator, progress)`` with a
    fresh generator from the same ``seed`` each, timing each call.

    ``progress(fraction)`` may be called by ``run`` with the fraction of its work done; ``report(overall
    fraction, description)`` receives it (the page's progress bar).
    """
    report = report or (lambda fraction, text: None)

    def stage(offset: float, text: str) -> Callable[[float], None]:
        return lambda fraction: report(offset + 0.5 * min(max(fraction, 0.0), 1.0), text)

    report(0.0, f"speculative run ({method})")
    spec, spec_seconds = timed(lambda: run(method, seeded(seed), stage(0.0, f"speculative run ({method})")))
    report(0.5, "baseline run (target only)")
    base, base_seconds = timed(lambda: run("none", seeded(seed), stage(0.5, "baseline run (target only)")))
    report(1.0, "done")
    return Comparison(method, spec, base, spec_seconds, base_seconds)


def warm_up_and_compare(cache: PipelineCache, pipe: Any, family: str, run: Callable[..., Any], method: str,
                        seed: int, *, warm_output_type: str, report: Report | None = None) -> Comparison:
    """:func:`compare` after one untimed call of ``method`` and of ``"none"`` per pipeline (``run(name, None,
    no progress, warm_output_type)``, see :meth:`PipelineCache.warm_up`), so one-off costs stay out of the
    timed runs. ``warm_output_type`` should skip decoding ("tokens", "latent")."""
    for name in (method, "none"):
        cache.warm_up(pipe, (family, name), lambda name=name: run(name, None, lambda fraction: None, warm_output_type))
    return compare(run, method, seed, report=report)


def _fmt(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def stats_html(comparison: Comparison, *, show_accepted_length: bool = True, unit: str = "tokens") -> str:
    """The statistics panel: wall time, speedup, mean accepted length and calls of both runs."""
    spec, base = comparison.speculative.stats, comparison.baseline.stats
    rows: list[tuple[str, str, str]] = [
        ("wall time (s)", f"{comparison.spec_seconds:.3f}", f"{comparison.base_seconds:.3f}"),
        ("speedup", f"{_fmt(comparison.speedup)}x", "1.00x"),
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


CPU_NOTE = ("Both runs are in this process, one after the other, same inputs and seed, after a warm-up. On a "
            "CPU at the zoo's sizes a forward costs about the same for 1 or 8 new tokens, as in a memory-bound "
            "GPU decode, so speedups are meaningful; absolute times are not GPU times.")
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


def upscale(image: PIL.Image.Image, size: int = 256) -> PIL.Image.Image:
    """Nearest-neighbour upscale so the longer side is at least ``size`` pixels (integer factor)."""
    factor = max(1, size // max(image.size))
    return image.resize((image.width * factor, image.height * factor), PIL.Image.NEAREST) if factor > 1 else image


def acceptance_overlay(image: PIL.Image.Image, drafted: torch.Tensor | np.ndarray, size: int = 256,
                       alpha: float = 0.45) -> PIL.Image.Image:
    """The per-token acceptance map over an image: tokens that were drafted and accepted tinted
    :data:`DRAFT_COLOR`, tokens the target produced tinted :data:`TARGET_COLOR`, thin grid lines between
    tokens. ``drafted`` is bool ``[h, w]`` (one entry per token of the image's grid)."""
    mask = np.asarray(drafted.cpu() if isinstance(drafted, torch.Tensor) else drafted, dtype=bool)
    if mask.ndim != 2:
        raise ValueError(f"drafted must be [h, w], got shape {mask.shape}")
    big = upscale(image.convert("RGB"), size)
    width, height = big.size
    grid_h, grid_w = mask.shape
    cell_h, cell_w = height // grid_h, width // grid_w
    full = mask.repeat(cell_h, 0).repeat(cell_w, 1)
    pixels = np.asarray(big.resize((cell_w * grid_w, cell_h * grid_h), PIL.Image.NEAREST), dtype=np.float32)
    tint = np.where(full[..., None], np.asarray(DRAFT_COLOR, np.float32), np.asarray(TARGET_COLOR, np.float32))
    mixed = (1 - alpha) * pixels + alpha * tint
    if cell_h >= 6 and cell_w >= 6:  # grid lines between tokens
        mixed[::cell_h, :, :] *= 0.6
        mixed[:, ::cell_w, :] *= 0.6
    return PIL.Image.fromarray(np.clip(mixed, 0, 255).astype(np.uint8))


def legend_html(items: Sequence[tuple[tuple[int, int, int], str]]) -> str:
    """A small colour legend."""
    spans = "".join(f"<span class='mmspec-legend-item'><span class='mmspec-swatch' style='background:rgb{color}'>"
                    f"</span>{html.escape(text)}</span>" for color, text in items)
    return f"<div class='mmspec-legend'>{spans}</div>"


MAP_LEGEND = ((DRAFT_COLOR, "drafted and accepted"), (TARGET_COLOR, "produced by the target"))


def panel(rows: Sequence[Sequence[PIL.Image.Image]], gap: int = 8) -> PIL.Image.Image:
    """Tiles of equal size in rows (white gaps between them): one picture for the page."""
    height, width = rows[0][0].height, rows[0][0].width
    columns = max(len(row) for row in rows)
    canvas = PIL.Image.new("RGB", (columns * width + (columns - 1) * gap, len(rows) * height + (len(rows) - 1) * gap),
                           (255, 255, 255))
    for r, row in enumerate(rows):
        for c, tile in enumerate(row):
            canvas.paste(tile.convert("RGB").resize((width, height), PIL.Image.NEAREST), (c * (width + gap), r * (height + gap)))
    return canvas


def image_panels(comparison: Comparison, size: int = 192) -> tuple[PIL.Image.Image, PIL.Image.Image]:
    """The pictures of an image comparison: speculative images with their acceptance maps beside them
    (one row per image), and the baseline's images (one per row, aligned with the speculative rows)."""
    spec = comparison.speculative
    spec_images, base_images = to_pil_list(spec.images), to_pil_list(comparison.baseline.images)
    rows = [[upscale(image, size), acceptance_overlay(image, spec.drafted[i], size)] for i, image in enumerate(spec_images)]
    return panel(rows), panel([[upscale(image, size)] for image in base_images])


@dataclass
class ImageResult:
    """What an image tab shows: the speculative images with their acceptance maps (one row per image),
    the baseline's images, the statistics panel, and the comparison itself."""

    gallery: PIL.Image.Image
    baseline: PIL.Image.Image
    stats_html: str
    comparison: Comparison

    @classmethod
    def from_comparison(cls, comparison: Comparison) -> ImageResult:
        """The panels (:func:`image_panels`) and statistics (:func:`stats_html`) of ``comparison``."""
        gallery, baseline = image_panels(comparison)
        return cls(gallery, baseline, stats_html(comparison), comparison)
