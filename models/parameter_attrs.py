"""``dtype`` and ``device`` of a model read off one parameter, for models called many times per sample.

diffusers' ``ModelMixin.dtype`` / ``.device`` look for group-offloading hooks by walking every submodule on
each access before they read a parameter, and the video model reads both several times per denoising pass
(casting its inputs, building position and timestep tensors): with the mixin, every method of the video
benchmark ran about 20 % faster (docs/pipeline_video.md). The models that use this mixin keep all their weights in one
dtype on one device and are never group-offloaded, so the first parameter answers both questions.
"""

from __future__ import annotations

import torch


class ParameterDtypeDeviceMixin:
    """Put before ``ModelMixin`` in the bases: ``dtype`` and ``device`` are those of the first parameter."""

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device
