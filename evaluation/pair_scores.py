"""What the per-pair scorers (:mod:`.clip_score`, :mod:`.imagereward`) share: checking the (image, prompt)
pairs they are given, an optional progress bar, the result's per-image records, and the command line's
output options (``--output`` summary JSON, ``--per-image`` JSON lines, ``--no-progress``)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from typing import Any, TypeVar

from PIL import Image

from .files import write_json_atomic, write_jsonl_atomic

T = TypeVar("T")


def check_pairs(images: Iterable[Image.Image], prompts: Iterable[str]) -> tuple[list[Image.Image], list[str]]:
    """``images`` and ``prompts`` as lists of the same, non-zero length (ValueError otherwise)."""
    images, prompts = list(images), list(prompts)
    if len(images) != len(prompts):
        raise ValueError(f"images and prompts differ in length: {len(images)} vs {len(prompts)}")
    if not images:
        raise ValueError("images: no images given")
    return images, prompts


def with_progress(items: Sequence[T], progress: bool, desc: str, unit: str) -> Iterable[T]:
    """``items``, wrapped in a tqdm progress bar when ``progress`` (tqdm imported only then)."""
    if not progress:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit=unit)


class PerImageResult:
    """Mixin of the scorers' result dataclasses: a ``per_image`` list of records, left out of
    :meth:`to_dict` unless asked for (the summary JSON stays small)."""

    per_image: list[dict[str, Any]]

    def to_dict(self, with_per_image: bool = False) -> dict:
        d = asdict(self)  # type: ignore[call-overload]
        if not with_per_image:
            d.pop("per_image")
        return d


def add_output_arguments(parser: argparse.ArgumentParser, per_image_help: str) -> None:
    """``--output`` (the summary as JSON), ``--per-image`` (``per_image_help``) and ``--no-progress``."""
    parser.add_argument("--output", default=None, help="write the summary as JSON here")
    parser.add_argument("--per-image", default=None, help=per_image_help)
    parser.add_argument("--no-progress", action="store_true")


def write_outputs(args: argparse.Namespace, result: PerImageResult) -> None:
    """Write what :func:`add_output_arguments`' options asked for, atomically."""
    if args.output:
        write_json_atomic(args.output, result.to_dict())
    if args.per_image:
        write_jsonl_atomic(args.per_image, result.per_image)
