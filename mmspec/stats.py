"""Speculation statistics shared by every pipeline.

Every count is of tokens the output kept: a verification's tokens past a row's EOS or its
``max_new_tokens`` are discarded and not counted. ``mean_accepted_length`` is the kept tokens per
(row, target verification), the bonus/corrected token included: target-only decoding has exactly 1.0, a
perfect K-token drafter K+1 except where a row ends, and a batch-1 run has
``(tokens - 1) / (target_calls - 1)`` in :func:`~mmspec.speculate.speculative_generate`
(the prefill's token is the only one no verification produced).
Papers differ here (ViSpec reports tau without the bonus); ``mean_accepted_drafts`` is that other
convention, one less.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class SpecStats:
    """Counters of one generation call (all rows of the batch together).

    Attributes:
        target_calls: target forward passes (prefill included).
        draft_calls: drafter forward passes.
        tokens: tokens produced (all rows, committed output only).
        verify_steps: (row, verification) pairs of rows still generating: the denominator of the mean
            accepted length.
        emitted: tokens those verifications added to the output: each row's accepted drafts and the
            target's token, cut at the row's EOS / ``max_new_tokens``.
        position_attempts / position_accepts: per draft position i, how often it was verified / accepted,
            counting only positions whose token the output kept.
        phase_seconds: wall time per phase ("prefill", "draft", "target", "verify", ...).
        phase_calls: how often each phase was entered: ``phase_calls["target"]`` counts the target's forwards
            after the prefill (one per round of a token loop), the denominator of a round's breakdown.
    """

    target_calls: int = 0
    draft_calls: int = 0
    tokens: int = 0
    verify_steps: int = 0
    emitted: int = 0
    position_attempts: list[int] = field(default_factory=list)
    position_accepts: list[int] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    phase_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def mean_accepted_length(self) -> float:
        """Kept tokens per (row, target verification), bonus/corrected token included."""
        return self.emitted / self.verify_steps if self.verify_steps else 0.0

    @property
    def mean_accepted_drafts(self) -> float:
        """:attr:`mean_accepted_length` without the target's token of each verification (ViSpec's tau)."""
        return (self.emitted - self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    @property
    def acceptance_rates(self) -> list[float]:
        """Per draft position: P(position i accepted | position i verified)."""
        return [a / n if n else 0.0 for a, n in zip(self.position_accepts, self.position_attempts)]

    @property
    def wall_seconds(self) -> float:
        return sum(self.phase_seconds.values())

    def record_verification(self, num_accepted: torch.Tensor | list[int], num_drafted: int | torch.Tensor,
                            active: torch.Tensor | list[bool] | None = None, kept: list[int] | None = None) -> None:
        """Count one verification of the rows in ``active`` (bool ``[B]``, a tensor or a list; all rows when None).

        ``num_accepted``: accepted drafts per row, ``[B]`` or a list. ``num_drafted``: the draft positions
        checked along the accepted chain (K for chains, the path depth bound for trees), scalar or per row.
        ``kept``: how many of each row's new tokens (its accepted drafts, then the target's token) the output
        took before the row's EOS / length limit; None: all of them. A row that kept none had finished and
        is not counted; positions past what a row kept count neither as verified nor as accepted.
        """
        # plain Python lists: this runs once per round, right after the target's forward, where every
        # small tensor operation costs several times its isolated time
        accepted = num_accepted if isinstance(num_accepted, list) else num_accepted.tolist()
        rows = len(accepted)
        counted = [True] * rows if active is None else active if isinstance(active, list) else active.tolist()
        taken = [n + 1 for n in accepted] if kept is None else kept
        drafted = [num_drafted] * rows if isinstance(num_drafted, int) else \
            torch.as_tensor(num_drafted).expand(rows).tolist()
        steps = [(n, k, t) for n, k, t, keep in zip(accepted, drafted, taken, counted) if keep and t > 0]
        self.verify_steps += len(steps)
        self.emitted += sum(min(n + 1, t) for n, _, t in steps)
        self.grow_positions(max(drafted, default=0))
        for n, k, t in steps:
            # position i is verified iff every earlier one was accepted, and kept iff i < t
            for i in range(min(n + 1, k, t)):
                self.position_attempts[i] += 1
            for i in range(min(n, t)):
                self.position_accepts[i] += 1

    def grow_positions(self, length: int) -> None:
        """Per-position counters for at least ``length`` draft positions."""
        while len(self.position_attempts) < length:
            self.position_attempts.append(0)
            self.position_accepts.append(0)

    def record_position_checks(self, accepted: torch.Tensor) -> None:
        """Per-position acceptance of drafts that are *all* verified (block-wise drafting, MuLo-SD):
        ``accepted`` bool ``[B, L]``; unlike a chain, a rejection does not stop later positions."""
        batch, length = accepted.shape
        self.grow_positions(length)
        for i, count in enumerate(accepted.long().sum(0).tolist()):
            self.position_attempts[i] += batch
            self.position_accepts[i] += count

    @classmethod
    def merge(cls, parts: Iterable[SpecStats]) -> SpecStats:
        """One record for several runs (e.g. the batches of a benchmark): every counter summed."""
        total = cls()
        for part in parts:
            for name in ("target_calls", "draft_calls", "tokens", "verify_steps", "emitted"):
                setattr(total, name, getattr(total, name) + getattr(part, name))
            for mine, theirs in ((total.position_attempts, part.position_attempts),
                                 (total.position_accepts, part.position_accepts)):
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, count in enumerate(theirs):
                    mine[i] += count
            for phase, seconds in part.phase_seconds.items():
                total.phase_seconds[phase] += seconds
            for phase, count in part.phase_calls.items():
                total.phase_calls[phase] += count
        return total

    @contextmanager
    def phase(self, name: str):
        """Time a block of work under ``name`` (accumulates)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[name] += time.perf_counter() - start
            self.phase_calls[name] += 1

    def as_dict(self) -> dict:
        return {
            "target_calls": self.target_calls, "draft_calls": self.draft_calls, "tokens": self.tokens,
            "verify_steps": self.verify_steps, "mean_accepted_length": self.mean_accepted_length,
            "mean_accepted_drafts": self.mean_accepted_drafts, "acceptance_rates": self.acceptance_rates,
            "phase_seconds": dict(self.phase_seconds), "phase_calls": dict(self.phase_calls),
            "wall_seconds": self.wall_seconds,
        }

    def __str__(self) -> str:
        return (f"SpecStats(tokens={self.tokens}, target_calls={self.target_calls}, draft_calls={self.draft_calls}, "
                f"mean_accepted_length={self.mean_accepted_length:.2f} (incl. bonus), "
                f"wall={self.wall_seconds:.3f}s)")
