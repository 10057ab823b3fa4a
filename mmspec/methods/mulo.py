"""MuLo-SD: a low-resolution AR drafter proposes whole blocks of rows, an up-sampler maps them to the
target's grid, the target verifies the block in one pass with the pooled threshold rule and redraws only
the rejected tokens' neighbourhoods (block-wise local rejection, :mod:`mmspec.local_speculate`).

The pipeline provides ``mulo_drafter``, ``mulo_upsampler``, ``vqvae``, ``grid_size`` and
``codebook_neighbors(k)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch

from mmspec.local_speculate import local_speculative_generate
from mmspec.methods.base import (
    BuildRequest,
    MethodConfig,
    MethodPlan,
    check_choice_field,
    check_float_field,
    check_int_field,
    register,
)
from mmspec.rules import PoolingThresholdRule
from mmspec.speculate import SpeculativeOutput
from mmspec.validation import check_guidance_scale


@register("mulo")
@dataclass(frozen=True)
class MuLoConfig(MethodConfig):
    """MuLo-SD (lossy with its pooled rule; "reverify" resampling keeps quality, "parallel" trades it for speed).

    Attributes:
        k: a draft is kept when the target's mass on it and its k nearest codebook neighbours reaches ``tau``.
        tau: the pooled threshold in (0, 1].
        radius: rejected tokens grow into a square neighbourhood of this radius that is resampled.
        resample: "reverify" (drafts kept up to the first rejection, which is redrawn; the rest of the block is
            refined and verified again), "sequential" (redrawn in raster order, each seeing the final tokens
            before it; one target call per redrawn column) or "parallel" (the paper's: every redrawn token from
            the block's one target pass; fastest, but on the zoo it costs most of the quality).
        guidance_scale: classifier-free guidance of the low-res drafter (None: the target's; 1.0 under a
            guided target drafts unguided from the conditional rows). Drafts only: the target decides.
    """

    pipelines: ClassVar[tuple[str, ...]] = ("ar_image",)

    k: int = 16
    tau: float = 0.3
    radius: int = 1
    resample: str = "reverify"
    guidance_scale: float | None = None

    def validate(self) -> None:
        check_int_field(self, "k", 1)
        check_float_field(self, "tau", 0.0, 1.0, low_open=True)
        check_int_field(self, "radius", 0, 64)
        check_choice_field(self, "resample", ("reverify", "sequential", "parallel"))
        if self.guidance_scale is not None:
            check_guidance_scale(self.guidance_scale, "MuLoConfig.guidance_scale")

    def build(self, pipeline: Any, request: BuildRequest) -> MethodPlan:
        from mmspec.models.mulo import MuLoDrafter

        if pipeline.mulo_drafter is None or pipeline.mulo_upsampler is None:
            raise ValueError("method 'mulo' needs mulo_drafter and mulo_upsampler; this pipeline lacks them")
        vocab = int(pipeline.transformer.config.vocab_size)
        if self.k > vocab - 1:
            raise ValueError(f"MuLoConfig.k must be at most the image vocabulary minus one ({vocab - 1}), got {self.k}")
        draft_scale = request.guidance_scale if self.guidance_scale is None else self.guidance_scale
        if request.guidance_scale == 1.0 and draft_scale != 1.0:
            raise ValueError(f"MuLoConfig.guidance_scale={draft_scale} needs a guided target (guidance_scale != 1): "
                             "the drafter's unconditional rows come from the target's guided prompt batch")
        drafter = MuLoDrafter(pipeline.mulo_drafter, pipeline.mulo_upsampler, pipeline.vqvae,
                              sampling=request.sampling, guidance_scale=float(draft_scale),
                              generator=request.generator, guided_prompt=request.guidance_scale != 1.0)
        rule = PoolingThresholdRule(pipeline.codebook_neighbors(self.k), k=self.k, tau=self.tau, greedy=request.greedy)
        grid = (pipeline.grid_size, pipeline.grid_size)
        loop = partial(block_loop, grid=grid, block_rows=int(pipeline.mulo_upsampler.config.ratio),
                       radius=self.radius, resample=self.resample)
        return MethodPlan(drafter=drafter, rule=rule, loop=loop)


def block_loop(target: Any, drafter: Any, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
               *, grid: tuple[int, int], block_rows: int, radius: int, resample: str, max_new_tokens: int,
               callback: Callable | None = None, **kwargs: Any) -> SpeculativeOutput:
    """MuLo-SD's block-wise loop behind the token loop's signature (:func:`~mmspec.speculate.speculative_generate`:
    ``(target, drafter, input_ids, attention_mask, *, max_new_tokens, sampling, rule, generator, callback,
    **model_inputs)``): the same output fields, the callback called per block as ``(tokens, drafted)``."""
    if max_new_tokens != grid[0] * grid[1]:
        raise ValueError(f"MuLo-SD decodes whole images: max_new_tokens must be {grid[0] * grid[1]}, "
                         f"got {max_new_tokens}")
    out = local_speculative_generate(
        target, drafter, grid, block_rows=block_rows, radius=radius, input_ids=input_ids,
        attention_mask=attention_mask, resample=resample,
        callback=None if callback is None else (lambda block, tokens, drafted: callback(tokens, drafted)), **kwargs)
    batch = out.sequences.shape[0]
    sequences = out.sequences.reshape(batch, -1)
    lengths = torch.full((batch,), sequences.shape[1], dtype=torch.long, device=sequences.device)
    return SpeculativeOutput(sequences, lengths, out.drafted.reshape(batch, -1), out.stats)
