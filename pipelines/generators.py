"""A list of generators, one per output, as diffusers pipelines take them.

Speculative decoding draws drafts, acceptance uniforms and resampled tokens for the whole batch from one
random stream, so one generator cannot make an image independent of its batch-mates. A list gives each
output its own stream: the pipeline then decodes each output alone with its generator (:func:`split_generators`
checks the list) and concatenates the results (:func:`concat_outputs`). Output i then equals a call for that
output alone with ``generators[i]``, whatever else is in the call; one generator keeps the batch in one loop,
which is faster. During such a call ``callback_on_step_end`` still sees the whole call's rows
(:class:`RowCallback`): each output's own steps, its row filled in and the others padded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch


def check_generator(generator: Any, unit: str) -> None:
    """``generator`` must be None, one ``torch.Generator`` or a list of them (one per ``unit``: "image", "video",
    "prompt"); the list's length and entries are checked where the call's outputs are known
    (:func:`split_generators`)."""
    if generator is not None and not isinstance(generator, (torch.Generator, list, tuple)):
        raise ValueError(f"generator must be a torch.Generator or a list of them (one per {unit}), got "
                         f"{type(generator).__name__}")


def split_generators(generator: Any, num_outputs: int, unit: str) -> list[torch.Generator] | None:
    """The per-output generators of ``generator`` when it is a list or tuple (None otherwise: one stream).

    Raises:
        ValueError: a list whose length is not ``num_outputs`` (``unit``: "images", "videos", "prompts") or
            with an entry that is not a ``torch.Generator``.
    """
    if not isinstance(generator, (list, tuple)):
        return None
    if len(generator) != num_outputs:
        raise ValueError(f"generator is a list of {len(generator)} generators, but the call makes {num_outputs} "
                         f"{unit}: give one per {unit.rstrip('s')} (or one torch.Generator for the whole call)")
    bad = [i for i, g in enumerate(generator) if not isinstance(g, torch.Generator)]
    if bad:
        raise ValueError(f"generator[{bad[0]}] is a {type(generator[bad[0]]).__name__}, not a torch.Generator")
    return list(generator)


def concat_outputs(parts: Sequence[Any]) -> Any:
    """Concatenate per-output results along the batch: tensors and arrays on their first axis, lists joined,
    None kept (every part None)."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.cat(list(parts))
    if isinstance(first, np.ndarray):
        return np.concatenate(list(parts))
    if isinstance(first, list):
        return [item for part in parts for item in part]
    raise TypeError(f"cannot concatenate outputs of type {type(first).__name__}")


def merge_image_outputs(output_class: type, parts: Sequence[Any]) -> Any:
    """One image-pipeline output (``images``, ``tokens``, ``stats``, ``drafted``) from the outputs of each image's
    own call: images and tensors concatenated along the batch, statistics merged by their class's ``merge``."""
    stats = type(parts[0].stats).merge(p.stats for p in parts)
    return output_class(images=concat_outputs([p.images for p in parts]), tokens=torch.cat([p.tokens for p in parts]),
                        stats=stats, drafted=torch.cat([p.drafted for p in parts]))


class RowCallback:
    """The ``callback_on_step_end`` of output ``row``'s own call inside a call with a list of generators: it
    spreads that call's one-row tensors over the whole call's ``num_rows`` rows (the other rows filled with
    ``fill[name]``: e.g. -1 for token ids, False for flags) and hands them to the outer call's
    :class:`~mmspec.pipelines.callbacks.StepCallback`, which picks the requested tensors and checks the result.
    Entries that are not one-row tensors (or have no fill value) pass as they are. The step index and
    ``timestep`` are the row's own (they restart for each output)."""

    def __init__(self, step_callback: Any, row: int, num_rows: int, fill: Mapping[str, Any]) -> None:
        self.step_callback, self.row, self.num_rows, self.fill = step_callback, row, num_rows, dict(fill)

    def __call__(self, pipeline: Any, step: int, timestep: Any, callback_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        return self.step_callback(step, timestep, {name: self._spread(name, value)
                                                   for name, value in callback_kwargs.items()})

    def _spread(self, name: str, value: Any) -> Any:
        if name not in self.fill or not isinstance(value, torch.Tensor) or value.ndim == 0 or value.shape[0] != 1:
            return value
        full = value.new_full((self.num_rows, *value.shape[1:]), self.fill[name])
        full[self.row] = value[0]
        return full


def row_callbacks(step_callback: Any, num_rows: int, fill: Mapping[str, Any]) -> list[RowCallback | None]:
    """One :class:`RowCallback` per output (None for each when the call has no callback)."""
    if not step_callback.active:
        return [None] * num_rows
    return [RowCallback(step_callback, row, num_rows, fill) for row in range(num_rows)]
