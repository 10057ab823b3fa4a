"""Run the pipelines' decoding loops under ``torch.inference_mode`` and hand back ordinary tensors.

Why: speculative decoding at small batch is dominated by per-op overhead (many small ops per draft step
and per round of bookkeeping). ``torch.inference_mode`` skips the version counters and view tracking
that ``torch.no_grad`` still keeps, which makes every op a little cheaper; on the shapes zoo a whole
generation runs about 10-20 % faster at batch 1 on a CPU (docs/core.md, "Inference mode").

The catch is that tensors created in inference mode are *inference tensors*: they cannot be updated in
place outside inference mode, nor saved for backward by autograd. So

* :func:`inference_call` converts what a call returns (dataclass outputs, lists, dicts, tuples) into
  ordinary tensors, so users can edit outputs in place or feed them to training code;
* :func:`outside_inference_mode` is for state that outlives a call (lookup tables, lazily built scorer
  models): it builds them as ordinary tensors even inside a call, so later code may use them freely.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def as_ordinary_tensors(value: Any) -> Any:
    """``value`` with every inference tensor replaced by an ordinary copy (in place for dataclasses, lists
    and dicts, which are returned too). Other objects (PIL images, arrays, modules, strings) pass through."""
    if isinstance(value, torch.Tensor):
        if value.is_inference():
            with torch.inference_mode(False):
                return value.clone()
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            item = getattr(value, field.name)
            converted = as_ordinary_tensors(item)
            if converted is not item:
                try:
                    setattr(value, field.name, converted)  # diffusers' BaseOutput also updates its dict view
                except dataclasses.FrozenInstanceError:
                    object.__setattr__(value, field.name, converted)
        return value
    if isinstance(value, list):
        value[:] = [as_ordinary_tensors(item) for item in value]
        return value
    if isinstance(value, tuple):
        converted = [as_ordinary_tensors(item) for item in value]
        if all(new is old for new, old in zip(converted, value)):
            return value
        return type(value)(*converted) if hasattr(value, "_fields") else tuple(converted)
    if isinstance(value, dict):
        for key, item in value.items():
            converted = as_ordinary_tensors(item)
            if converted is not item:
                value[key] = converted
        return value
    return value


def inference_call(fn: F) -> F:
    """Decorator for a pipeline's ``__call__``: the body runs under ``torch.inference_mode()`` (which also
    disables gradients), and the result is returned with ordinary tensors (:func:`as_ordinary_tensors`).

    Callbacks the body invokes (``callback_on_step_end``, streaming) run inside inference mode and see
    inference tensors; they should clone what they keep if they intend to modify it in place.
    """
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode():
            result = fn(*args, **kwargs)
        return as_ordinary_tensors(result)

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def outside_inference_mode() -> Iterator[None]:
    """Build ordinary tensors (gradients still off) even when called inside inference mode: for state that
    is cached beyond one call (e.g. LANTERN's codebook-neighbour table, a reward's scorer model)."""
    with torch.inference_mode(False), torch.no_grad():
        yield
