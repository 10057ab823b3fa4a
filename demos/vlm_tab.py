"""The VLM tab: image or video frames + prompt -> text (:class:`~mmspec.pipelines.VLMPipeline`). The
speculative answer streams with its accepted draft tokens highlighted (flowing text, draft spans marked:
:func:`answer_html`); then both sides are timed by the CLI's protocol (:func:`~mmspec.demos.timing.compare`)
on the same inputs and seed. The method runs with the checkpoint's stored settings, the page's knobs (K, a
draft tree) over them (:func:`method_config`)."""

from __future__ import annotations

import html
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image

from mmspec.demos.common import (
    CPU_NOTE,
    LENGTH_NOTE,
    MAX_SEED,
    DemoError,
    PipelineCache,
    check_choice,
    check_int,
    headline_html,
    sampling_kwargs,
    stats_html,
    tree_config,
)
from mmspec.demos.timing import DEFAULT_REPEATS, MAX_REPEATS, Comparison, compare, seeded

METHODS = ("eagle", "flash", "vispec", "specvlm", "draft_vlm")
DEFAULT_PATH = "mmspec/shapes-vlm"
MAX_FRAMES = 16
DRAFT_LABEL = "accepted draft"
STREAM_INTERVAL = 0.1  # seconds between streamed page updates
NO_EXAMPLE = "(none: use my upload)"
#: shapes-world examples: name -> (kind, index); images from the world's held-out "test" stream
EXAMPLES = {"shapes scene 0 (image)": ("image", 0), "shapes scene 1 (image)": ("image", 1),
            "shapes scene 2 (image)": ("image", 2), "shapes clip 0 (video, 4 frames)": ("video", 0),
            "shapes clip 1 (video, 4 frames)": ("video", 1)}
PROMPTS = {"image": "describe the image in detail.", "video": "narrate the video."}

INPUTS = ("path", "files", "example", "prompt", "method", "max_new_tokens", "seed", "greedy", "temperature",
          "num_draft_tokens", "use_tree", "tree_depth", "tree_top_k", "tree_total_tokens", "repeats")
#: what the page says when the zoo's captioner gets an upload: it knows only the shapes world
ZOO_NOTE = ("The bundled captioner (mmspec/shapes-vlm) was trained only on the synthetic shapes world: on any "
            "other picture it still describes coloured shapes. For real images, load a real VLM pipeline folder "
            "(e.g. a LLaVA with its EAGLE head, saved with save_pretrained) under advanced > checkpoint path.")


@dataclass
class VLMView:
    """One update of the tab: the speculative text as ``(piece, label)`` segments (label
    :data:`DRAFT_LABEL` for accepted draft tokens, None for the target's), the baseline text, the
    statistics panel and a status line; ``comparison`` and the result card ``card_html`` are set on the final
    update."""

    highlighted: list[tuple[str, str | None]]
    baseline: str = ""
    stats_html: str = ""
    status: str = ""
    comparison: Comparison | None = None
    done: bool = False
    frames: list[PIL.Image.Image] = field(default_factory=list)
    card_html: str = ""


def example_inputs(name: str) -> tuple[list[PIL.Image.Image], str]:
    """The frames (one for an image, several for a clip) and the default prompt of a shapes example."""
    from mmspec.models import shapes_vlm as sv

    if name not in EXAMPLES:
        raise DemoError(f"example must be one of {list(EXAMPLES)}, got {name!r}")
    kind, index = EXAMPLES[name]
    if kind == "image":
        frames = sv.image_example("test", 0, index, "describe")["frames"]
    else:
        frames = sv.video_example("test", 0, index, "narrate")["frames"]
    return [PIL.Image.fromarray(np.asarray(frame)) for frame in frames], PROMPTS[kind]


def read_uploads(files: Any) -> list[PIL.Image.Image]:
    """Images from the upload field (paths, or objects with a ``name``/``path``), in the given order."""
    if files is None:
        return []
    items = files if isinstance(files, (list, tuple)) else [files]
    if len(items) > MAX_FRAMES:
        raise DemoError(f"at most {MAX_FRAMES} images (video frames) per run, got {len(items)}")
    frames = []
    for item in items:
        path = item if isinstance(item, (str, os.PathLike)) else getattr(item, "path", None) or getattr(item, "name", None)
        if path is None:
            raise DemoError(f"could not read the upload {item!r}: not a file")
        try:
            with PIL.Image.open(path) as image:
                frames.append(image.convert("RGB"))
        except (OSError, ValueError, PIL.Image.DecompressionBombError):
            # the error's own text names the server's temp path: the file's name is what the user knows
            raise DemoError(f"could not read {Path(path).name!r} as an image: upload PNG or JPEG files") from None
    return frames


def visual_inputs(files: Any, example: Any) -> tuple[list[PIL.Image.Image], str]:
    """The frames of a run: the uploads if any, else the chosen shapes example; ``(frames, kind)`` with
    kind "image" (one frame) or "video"."""
    frames = read_uploads(files)
    if not frames and example and example != NO_EXAMPLE:
        frames, _ = example_inputs(example)
    if not frames:
        raise DemoError("no image: upload an image (or a few video frames) or pick a shapes example")
    return frames, "image" if len(frames) == 1 else "video"


class TokenPieces:
    """Splits generated ids into per-token text pieces by incremental decoding (decode the prefix, take
    the new suffix), so word pieces and spaces come out as the tokenizer writes them."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self.pieces: list[tuple[str, str | None]] = []

    def add(self, ids: list[int], drafted: list[bool]) -> None:
        for token, was_drafted in zip(ids, drafted):
            self.ids.append(int(token))
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            piece = text[len(self.text):] if text.startswith(self.text) else text
            self.text = text
            if piece:
                self.pieces.append((piece, DRAFT_LABEL if was_drafted else None))


def answer_html(pieces: list[tuple[str, str | None]], streaming: bool = False) -> str:
    """The answer as flowing text: runs of accepted draft tokens in one highlighted span each (adjacent
    drafted pieces merged, so a span reads as the words the drafter got right), the target's tokens plain;
    ``streaming`` adds a cursor."""
    spans: list[tuple[str, bool]] = []
    for piece, label in pieces:
        drafted = label == DRAFT_LABEL
        if spans and spans[-1][1] == drafted:
            spans[-1] = (spans[-1][0] + piece, drafted)
        else:
            spans.append((piece, drafted))
    body = "".join(f"<mark class='mmspec-draft'>{html.escape(text)}</mark>" if drafted else html.escape(text)
                   for text, drafted in spans)
    cursor = "<span class='mmspec-cursor'>&#9608;</span>" if streaming else ""
    return f"<div class='mmspec-answer'>{body}{cursor}</div>"


def is_zoo_checkpoint(path: Any) -> bool:
    """Whether ``path`` names the bundled shapes captioner."""
    return isinstance(path, str) and path.strip().rstrip("/").endswith("shapes-vlm")


def method_config(pipe: Any, method: str, *, greedy: bool, num_draft_tokens: Any = None, use_tree: bool = False,
                  tree_depth: Any = 5, tree_top_k: Any = 8, tree_total_tokens: Any = 48) -> Any:
    """The page's settings of ``method``: the checkpoint's stored ones for the mode (``pipe.method_config``,
    what a call with only ``method=`` runs) with the knobs the page shows replaced, each checked under its
    label. Knob -> config field: K -> ``num_draft_tokens`` (an empty field keeps the stored K), the tree
    fields -> ``tree`` (a tree's own expansion decides its length, so it drops any stored confidence
    cut-off; FLASH drafts chains only and refuses one)."""
    config = pipe.method_config(method, do_sample=not greedy)
    fields: dict[str, Any] = {}
    if not (num_draft_tokens is None or (isinstance(num_draft_tokens, str) and not num_draft_tokens.strip())):
        fields["num_draft_tokens"] = check_int("K (draft tokens)", num_draft_tokens, 1, 32)
    if use_tree:
        if not config.supports_tree:
            raise DemoError(f"{method} drafts chains only: untick the draft tree")
        fields.update(tree=tree_config(tree_depth, tree_top_k, tree_total_tokens), draft_confidence_threshold=0.0)
    return config.replace(**fields) if fields else config


def run_vlm(cache: PipelineCache, *, path: str = DEFAULT_PATH, files: Any = None,
            example: str | None = next(iter(EXAMPLES)), prompt: str = "", method: str = "eagle",
            max_new_tokens: int = 200, seed: int = 0, greedy: bool = True, temperature: float = 1.0,
            num_draft_tokens: int | None = None, use_tree: bool = False, tree_depth: int = 5, tree_top_k: int = 8,
            tree_total_tokens: int = 48, repeats: int = DEFAULT_REPEATS) -> Iterator[VLMView]:
    """Stream the speculative answer (a :class:`VLMView` per verified round, untimed: it is what the page
    shows), then time both sides by the CLI's protocol (:func:`~mmspec.demos.timing.compare`: a warm-up call
    each, ``repeats`` alternating timed calls) with the same inputs and seed; the last view carries the
    result card, the statistics and the comparison. The method runs with the checkpoint's stored settings
    and the page's knobs over them (:func:`method_config`; an empty K keeps the stored one); the baseline gets
    the sampling settings only.

    An empty prompt takes the example's default ("describe the image in detail." or "narrate the video.").
    """
    from mmspec.pipelines.vlm import VLMStreamChunk

    method = check_choice("method", method, METHODS)
    frames, kind = visual_inputs(files, example)
    uploaded = bool(read_uploads(files))
    text = prompt.strip() if isinstance(prompt, str) else ""
    text = text or PROMPTS[kind]
    limit = check_int("max new tokens", max_new_tokens, 1, 1024)
    seed = check_int("seed", seed, 0, MAX_SEED)
    repeats = check_int("timed repeats", repeats, 1, MAX_REPEATS)
    kwargs = sampling_kwargs(greedy, temperature)
    pipe = cache.get("vlm", path)
    pipe.check_method(method)
    config = method_config(pipe, method, greedy=bool(greedy), num_draft_tokens=num_draft_tokens,
                           use_tree=bool(use_tree), tree_depth=tree_depth, tree_top_k=tree_top_k,
                           tree_total_tokens=tree_total_tokens)
    visual = {"images": frames[0]} if kind == "image" else {"videos": [frames]}

    pieces = TokenPieces(pipe.tokenizer)
    yield VLMView([], status=f"speculative run ({method}): streaming...", frames=frames)
    last_yield = time.perf_counter()
    for item in pipe.stream(**visual, prompt=text, method=config, max_new_tokens=limit, generator=seeded(seed),
                            **kwargs):
        if isinstance(item, VLMStreamChunk):
            pieces.add(item.tokens, item.drafted)
            now = time.perf_counter()
            if now - last_yield >= STREAM_INTERVAL:  # coalesce rounds: the page needs no more than ~10 updates/s
                last_yield = now
                yield VLMView(list(pieces.pieces), status=f"speculative run ({method}): {len(pieces.ids)} tokens",
                              frames=frames)
    yield VLMView(list(pieces.pieces), status=f"timing: 1 warm-up and {repeats} alternating timed calls per side...",
                  frames=frames)

    def run(name: str, generator: Any, progress: Any) -> Any:
        return pipe(**visual, prompt=text, method=config if name != "none" else "none", max_new_tokens=limit,
                    generator=generator, **kwargs)

    comparison = compare(run, method, seed, repeats=repeats)
    final, base = comparison.speculative, comparison.baseline
    # the timed call's output is authoritative (rows stop at EOS); rebuild the pieces from it
    pieces = TokenPieces(pipe.tokenizer)
    pieces.add(final.tokens[0].tolist(), final.drafted[0].tolist())
    comparison.lossless = True
    spec_tokens, base_tokens = len(final.tokens[0]), len(base.tokens[0])
    same = final.text[0] == base.text[0]
    comparison.extra["tokens / s"] = (f"{spec_tokens / comparison.spec_seconds:.1f}",
                                      f"{base_tokens / comparison.base_seconds:.1f}")
    comparison.extra["accepted draft tokens"] = (f"{int(final.drafted[0].sum())} of {spec_tokens}", "0")
    visual_tokens = final.draft_visual_tokens[0] if final.draft_visual_tokens else None
    comparison.extra["draft-side visual tokens"] = ("-" if visual_tokens is None else str(visual_tokens), "-")
    comparison.extra["same text as the baseline"] = ("yes" if same else "no", "-")
    mode = "greedy" if greedy else f"sampling at temperature {kwargs['temperature']:g}"
    drafting = f"a tree {config.tree}" if config.tree is not None else f"chains of up to K={config.num_draft_tokens}"
    comparison.notes = [f"{'1 image' if kind == 'image' else f'{len(frames)} video frames'}, prompt {text!r}, {mode}, "
                        f"seed {seed}, at most {limit} new tokens; {method} drafts {drafting}.", LENGTH_NOTE,
                        "Every VLM method is lossless: greedy answers equal the baseline's token for token; sampled "
                        "answers follow the same distribution but use the random numbers differently.",
                        "The streamed answer is not timed; the timed calls run after it without streaming.",
                        CPU_NOTE]
    status = "done"
    if uploaded and is_zoo_checkpoint(path):
        comparison.notes.insert(0, ZOO_NOTE)
        status = "done. Note: " + ZOO_NOTE
    yield VLMView(list(pieces.pieces), base.text[0], stats_html(comparison), status,
                  comparison, True, frames, card_html=headline_html(comparison, identical=same))
