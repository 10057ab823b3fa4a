"""Building a training set in worker processes, with the same result as building it in one.

Every sample of the shapes world comes from its own random stream (``rng_for(split, seed, index)``), so a
set of ``total`` samples can be cut into contiguous slices built independently and concatenated in order:
the data does not depend on the number of workers. Rendering a scene is Python and numpy under the GIL,
so the slices go to processes, not threads. The recipes expose this as ``--data-workers`` (a GPU lease
spent a third to a half of its time building training sets in one process).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

from mmspec.validation import check_positive_int

Part = TypeVar("Part")


def part_bounds(total: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """``(first, count)`` of up to ``parts`` contiguous slices covering ``range(total)``, each starting at a
    multiple of ``align`` (a recipe that encodes its samples in batches of ``align`` then batches them as one
    process would), sizes as even as that allows; no slice is empty unless ``total`` is 0, which gives one
    empty slice."""
    for name, value, least in (("total", total, 0), ("align", align, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    check_positive_int(parts, "parts")
    units = -(-total // align)
    parts = max(1, min(parts, units))
    size, extra = divmod(units, parts)
    bounds, first = [], 0
    for i in range(parts):
        stop = min(total, first + (size + (i < extra)) * align)
        bounds.append((first, stop - first))
        first = stop
    return bounds


def _single_threaded() -> None:
    """Worker start-up: one torch thread each (the workers already split the machine)."""
    torch.set_num_threads(1)


def build_in_parts(build_part: Callable[[int, int], Part], total: int, workers: int = 1,
                   align: int = 1) -> list[Part]:
    """``build_part(first, count)`` over contiguous slices of ``range(total)``, in slice order.

    With ``workers == 1`` it is one call, ``build_part(0, total)``, in this process. Otherwise the slices
    (twice as many as workers, for balance; starting at multiples of ``align``, see :func:`part_bounds`)
    run in a pool of ``workers`` processes, one torch thread each, forked where the
    platform allows it; ``build_part`` and its results must pickle (a module-level function, or a
    ``functools.partial`` of one). The caller merges the parts (:func:`concat_parts` for the usual dict of
    tensors and lists); ``build_part`` must number its samples from ``first`` so the merged set equals the
    one-process build.
    """
    check_positive_int(workers, "data workers")
    bounds = part_bounds(total, 1 if workers == 1 else 2 * workers, align)
    if len(bounds) == 1:
        return [build_part(*bounds[0])]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # tokenizers' own threads do not survive a fork
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(max_workers=min(workers, len(bounds)), mp_context=multiprocessing.get_context(method),
                             initializer=_single_threaded) as pool:
        futures = [pool.submit(build_part, first, count) for first, count in bounds]
        return [future.result() for future in futures]


def concat_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge the dict parts of :func:`build_in_parts` key by key: tensors with ``torch.cat``, numpy arrays
    with ``np.concatenate``, lists joined, all along the sample axis and in part order."""
    if not parts:
        raise ValueError("concat_parts needs at least one part")
    merged: dict[str, Any] = {}
    for key, first in parts[0].items():
        values = [part[key] for part in parts]
        if isinstance(first, torch.Tensor):
            merged[key] = torch.cat(values)
        elif isinstance(first, np.ndarray):
            merged[key] = np.concatenate(values)
        elif isinstance(first, list):
            merged[key] = [item for value in values for item in value]
        else:
            raise TypeError(f"concat_parts: cannot merge {key!r} of type {type(first).__name__}")
    return merged
