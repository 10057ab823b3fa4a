"""Speculative coupled decoding (SCD, first titled MC-SJD): speculative Jacobi decoding whose window slots
are redrawn coupled with the tokens they held, so consecutive rounds propose the same token as often as the
two distributions allow. Training-free and lossless, like SJD; only the redraw differs
(:class:`~mmspec.drafters.JacobiDrafter` with ``coupled=True``).

The pipeline provides the transformer (its ``config.vocab_size``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmspec.drafters import JacobiDrafter
from mmspec.methods.base import BuildRequest, register
from mmspec.methods.jacobi import SJDConfig


@register("scd")
@dataclass(frozen=True)
class SCDConfig(SJDConfig):
    """Speculative coupled decoding (lossless): SJD's window and initialisation, coupled redraws.

    Attributes:
        window: draft slots verified per round.
        init: how fresh slots are filled: "random" (uniform tokens) or "left" (a copy of the slot before).

    Greedy decoding redraws by argmax either way, so greedy SCD is greedy SJD (Jacobi decoding).
    """

    def drafter(self, pipeline: Any, request: BuildRequest) -> JacobiDrafter:
        return JacobiDrafter(int(pipeline.transformer.config.vocab_size), window=self.window,
                             sampling=request.sampling, init=self.init, generator=request.generator, coupled=True)
