"""Helpers shared by the zoo tests."""

from __future__ import annotations

from typing import Any

import torch

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
