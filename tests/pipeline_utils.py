"""Helpers shared by the zoo tests."""

from __future__ import annotations

from typing import Any


def quiet_pipeline(pipeline_class: type, path: str) -> Any:
    """``pipeline_class.from_pretrained(path)`` with its progress bars off."""
    pipe = pipeline_class.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe
