"""Input checks shared by the core: clear ``ValueError``s that name the argument at fault.

Verification sits in every decoding loop, so the checks are cheap (shape/dtype logic plus a few
reductions) and can be switched off for hot loops that already validated their inputs once
(``MMSPEC_CHECKS=0`` or :func:`checks_enabled`).
"""

from __future__ import annotations

import argparse
import math
import os
from contextlib import contextmanager

import torch

_CHECKS = os.environ.get("MMSPEC_CHECKS", "1") != "0"


def checks_enabled() -> bool:
    """Whether the (cheap but not free) value checks on probability tensors run."""
    return _CHECKS


@contextmanager
def value_checks(enabled: bool):
    """Temporarily switch the probability value checks on or off (shape checks always run)."""
    global _CHECKS
    previous, _CHECKS = _CHECKS, enabled
    try:
        yield
    finally:
        _CHECKS = previous


def check_positive_int(value: int, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def positive_int_argument(text: str) -> int:
    """argparse ``type=`` of a count >= 1 (command-line options such as ``--quality-seeds``)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


#: Compute precisions a command line may ask for (``--dtype``): the checkpoints' float32, and bfloat16, the
#: precision such models are deployed in, which CPUs with bfloat16 instructions multiply fastest.
COMMAND_LINE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def dtype_argument(text: str) -> torch.dtype:
    """argparse ``type=`` of ``--dtype``: a name in :data:`COMMAND_LINE_DTYPES`."""
    if text not in COMMAND_LINE_DTYPES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(COMMAND_LINE_DTYPES)}, got {text!r}")
    return COMMAND_LINE_DTYPES[text]


def check_callable(value: object, name: str) -> None:
    """``value`` is None or callable (a pipeline's ``callback_on_step_end``), checked before any work."""
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be callable or None, got {type(value).__name__}")


def check_guidance_scale(value: float, name: str) -> None:
    """``value`` is a classifier-free guidance scale: a finite real number >= 0 (NaN, inf, booleans and
    strings rejected)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a number >= 0 (a finite number), got {value!r}")


def check_unit_interval(value: float, name: str) -> None:
    """``value`` is a real number in [0, 1) (NaN and booleans rejected)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")


def check_ndim(tensor: torch.Tensor, ndim: int, name: str, layout: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {layout}, got {type(tensor).__name__}")
    if tensor.ndim != ndim:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(tensor.shape)}")


def check_probs(probs: torch.Tensor, name: str, atol: float = 1e-3) -> None:
    """Probabilities must be floating, finite, non-negative and sum to 1 over the last dim."""
    if not probs.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor of probabilities, got {probs.dtype}")
    if not _CHECKS or probs.numel() == 0:
        return
    sums = probs.sum(-1)  # one pass: NaN/inf anywhere makes its row sum non-finite
    if not torch.isfinite(sums).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    if probs.amin() < 0:
        raise ValueError(f"{name} contains negative probabilities")
    worst = (sums - 1).abs().max().item()
    if worst > atol:
        raise ValueError(f"{name} is not normalised over the vocabulary (a row sums to {1 + worst:.4g} or "
                         f"{1 - worst:.4g}); pass probabilities, not logits")


def check_token_ids(tokens: torch.Tensor, vocab_size: int, name: str) -> None:
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be an integer tensor of token ids, got {tokens.dtype}")
    if not tokens.numel():
        return
    low, high = (int(value) for value in torch.aminmax(tokens))  # one pass, read on the host at once
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{name} has token ids outside [0, {vocab_size}) (min {low}, max {high})")
