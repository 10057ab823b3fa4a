"""A list of generators, one per output, as diffusers pipelines take them.

Speculative decoding draws drafts, acceptance uniforms and resampled tokens for the whole batch from one
random stream, so one generator cannot make an image independent of its batch-mates. A list gives each
output its own stream: the pipeline then decodes each output alone with its generator (:func:`split_generators`
checks the list) and concatenates the results (:func:`concat_outputs`). Output i then equals a call for that
output alone with ``generators[i]``, whatever else is in the call; one generator keeps the batch in one loop,
which is faster.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


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
