"""Helpers shared by the pipeline tests: comparing instances, quiet loading, a toy method registered from outside
the package."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from mmspec import methods
from mmspec.methods import MethodConfig, MethodPlan
from mmspec.methods.base import check_int_field
from mmspec.speculate import DraftChain, Drafter

#: Tolerance for comparing the outputs of two *separate* model instances with the same weights (a pipeline
#: and its save/load round trip): BLAS kernels may pick another reduction order for differently aligned
#: weight buffers, so float64 results can differ in the last bits. Within one instance, identical calls
#: are compared bit for bit with ``torch.equal``.
ACROSS_INSTANCES = {"rtol": 1e-9, "atol": 1e-12}


def assert_same_across_instances(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Two instances' float64 outputs agree up to reduction order (:data:`ACROSS_INSTANCES`)."""
    torch.testing.assert_close(actual, expected, **ACROSS_INSTANCES)


def quiet_pipeline(pipeline_class: type, path: str) -> Any:
    """``pipeline_class.from_pretrained(path)`` with its progress bars off."""
    pipe = pipeline_class.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe



# -- a method registered from outside the package ----------------------------------------------------------------
# The toy method ``copy_pending``, written as a user's plugin would be: a drafter, a config that builds it, and
# one ``register`` call. It runs in AR image and VLM pipelines (both decode tokens with the core's loop).


class CopyPendingDrafter(Drafter):
    """Every round proposes ``num_tokens`` copies of the pending token, as point masses (so verification keeps
    every exact rule exact)."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.proposals = 0

    def prefill(self, context: Any) -> None:
        self.proposals = 0

    def propose(self, pending: torch.Tensor) -> DraftChain:
        self.proposals += 1
        return DraftChain(pending.unsqueeze(1).expand(-1, self.capped(self.num_tokens)).clone())

    def commit(self, result: Any) -> None:
        pass


@dataclass(frozen=True)
class CopyPendingConfig(MethodConfig):
    """The toy method: ``num_tokens`` copies of the pending token per round (lossless)."""

    pipelines: ClassVar[tuple[str, ...]] = ("ar_image", "vlm")

    num_tokens: int = 3

    def validate(self) -> None:
        check_int_field(self, "num_tokens", 1, 64)

    def build(self, pipeline: Any, request: Any) -> MethodPlan:
        return MethodPlan(drafter=CopyPendingDrafter(self.num_tokens))


@contextmanager
def copy_pending_method(name: str = "copy_pending") -> Iterator[type[CopyPendingConfig]]:
    """The toy method registered as ``method=name`` while the block runs (removed afterwards)."""
    methods.register(name, CopyPendingConfig)
    try:
        yield CopyPendingConfig
    finally:
        methods.unregister(name)
