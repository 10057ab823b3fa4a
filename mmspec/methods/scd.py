"""Speculative coupled decoding (SCD, first titled MC-SJD): speculative Jacobi decoding whose window slots
are redrawn coupled with the tokens they held, so consecutive rounds propose the same token as often as the
two distributions allow. Training-free and lossless, like SJD; only the redraw differs
(:class:`~mmspec.drafters.JacobiDrafter` with ``coupled=True``).

The pipeline provides the transformer (its ``config.vocab_size``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmspec.drafters import COUPLINGS, FRESH_Q, JacobiDrafter
from mmspec.methods.base import BuildRequest, check_bool_field, check_choice_field, register
from mmspec.methods.jacobi import SJDConfig


@register("scd")
@dataclass(frozen=True)
class SCDConfig(SJDConfig):
    """Speculative coupled decoding (lossless): SJD's window and initialisation, coupled redraws.

    Attributes:
        window: draft slots verified per round.
        init: how fresh slots are filled: "random" (uniform tokens) or "left" (a copy of the slot before).
        keep_last_draw: keep the target's draw at the position after the last draft as the next window's
            draft there (True, as every released SCD variant does; a free draft in every round with a
            rejection) instead of a fresh slot (False, mmspec before issue 68). Lossless either way.
        fresh_q: the q of fresh random slots, "uniform" (their law) or "one_hot" (a point mass at the drawn
            token, the release's choice); both lossless, see :class:`~mmspec.drafters.JacobiDrafter`.
        coupling: "maximal" (keep the old token with probability min(1, p/q), else a residual draw) or "gumbel"
            (the release's Gumbel mode: a slot's fixed Gumbel noise, argmax(log p + g)); both lossless.

    Greedy decoding redraws by argmax either way, so greedy SCD is greedy SJD (Jacobi decoding).
    """

    keep_last_draw: bool = True
    fresh_q: str = "uniform"
    coupling: str = "maximal"

    def validate(self) -> None:
        super().validate()
        check_bool_field(self, "keep_last_draw")
        check_choice_field(self, "fresh_q", FRESH_Q)
        check_choice_field(self, "coupling", COUPLINGS)

    def drafter(self, pipeline: Any, request: BuildRequest) -> JacobiDrafter:
        return JacobiDrafter(int(pipeline.transformer.config.vocab_size), window=self.window,
                             sampling=request.sampling, init=self.init, generator=request.generator, coupled=True,
                             keep_last_draw=self.keep_last_draw, fresh_q=self.fresh_q, coupling=self.coupling)
