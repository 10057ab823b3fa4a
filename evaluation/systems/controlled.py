"""Controlled acceptance: the method's real drafter runs, but what it proposes is accepted with a known rate.

Acceptance depends on trained weights; the efficiency of a loop does not. :class:`ControlledDrafter` wraps the
drafter a method builds and calls it exactly as the loop would (its forwards, cache updates and rollbacks
are the product's, and so is their time), then replaces the tokens it proposed: each is the target's own
greedy continuation at that position, kept with probability ``alpha`` and otherwise replaced by another
token, independently. Under greedy verification a chain of K drafts then keeps a geometric prefix, so the
mean tokens per round (accepted drafts plus the target's token) is known in advance:
:func:`expected_tau`.

The greedy continuation (``reference``) comes from the target-only run of the same inputs, which the
benchmark runs first anyway as its baseline. Where the speculative run's greedy tokens differ from it
(float rounding of a wider forward flipping a near-tie), later drafts follow the wrong continuation; the
wrapper counts such positions (:attr:`ControlledDrafter.mismatches`) so a report can show they are rare.
"""

from __future__ import annotations

import torch

from mmspec.speculate import DraftChain, Drafter, PrefillContext, RoundResult
from mmspec.tree import DraftTree

from .timing import Timer


def expected_tau(alpha: float, num_draft_tokens: int) -> float:
    """Mean tokens per round of a K-draft chain whose drafts are each accepted with probability ``alpha``
    (the target's token included): ``(1 - alpha^(K+1)) / (1 - alpha)``."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if alpha == 1.0:
        return float(num_draft_tokens + 1)
    return (1.0 - alpha ** (num_draft_tokens + 1)) / (1.0 - alpha)


class ControlledDrafter(Drafter):
    """A method's drafter whose proposals are the target's greedy continuation, each token kept with
    probability ``alpha`` (else replaced by a different token below ``token_limit``).

    Args:
        inner: the drafter the method built (chains only: a tree's acceptance has no closed form here).
        reference: LongTensor ``[B, N]``, each row's greedy continuation from the target-only run (the
            prefill's token first).
        alpha: probability that a proposed token is the target's own.
        token_limit: replacement tokens are drawn below it (the first special id of a VLM's vocabulary, so a
            corrupted draft is never an image placeholder).
        timer: records ``draft_prefill``, ``draft`` (the inner drafter's propose and commit, per round) and
            ``controller`` (this wrapper's own work, which is not the product's and is excluded from the
            loop overhead).
        seed: seed of the corruption draws.
    """

    def __init__(self, inner: Drafter, reference: torch.Tensor, alpha: float, token_limit: int, timer: Timer,
                 seed: int = 0) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if reference.ndim != 2 or reference.shape[1] < 1:
            raise ValueError(f"reference must be the greedy continuation [B, N], got {tuple(reference.shape)}")
        if token_limit < 2:
            raise ValueError(f"token_limit must leave at least two tokens to choose from, got {token_limit}")
        self.inner, self.reference, self.alpha = inner, reference, alpha
        self.token_limit, self.timer = token_limit, timer
        self.needs_target_hidden = inner.needs_target_hidden
        self.target_hidden = inner.target_hidden
        self.generator = torch.Generator(device=reference.device).manual_seed(seed)
        self.position: torch.Tensor | None = None  # [B] index in reference of each row's pending token
        self.mismatch_count: torch.Tensor | None = None
        self.round_lengths: list[int] = []

    @property
    def calls(self) -> int:
        return self.inner.calls

    @property
    def draft_visual_tokens(self) -> torch.Tensor | None:  # type: ignore[override]
        return self.inner.draft_visual_tokens

    @property
    def mismatches(self) -> int:
        """Positions where the speculative run's target tokens left the reference continuation."""
        return 0 if self.mismatch_count is None else int(self.mismatch_count)

    def prefill(self, context: PrefillContext) -> None:
        batch = context.first_tokens.shape[0]
        if self.reference.shape[0] != batch:
            raise ValueError(f"reference has {self.reference.shape[0]} rows, the call {batch}")
        with self.timer.time("draft_prefill", essential=True):
            self.inner.prefill(context)
        with self.timer.time("controller"):
            self.position = torch.zeros(batch, dtype=torch.long, device=self.reference.device)
            self.mismatch_count = (context.first_tokens != self.reference[:, 0]).sum()

    def propose(self, pending: torch.Tensor) -> DraftChain:
        with self.timer.time("draft", "propose"):
            self.inner.draft_limit = self.draft_limit
            chain = self.inner.propose(pending)
        if isinstance(chain, DraftTree):
            raise ValueError("controlled acceptance needs draft chains; this method's config drafts an EAGLE-2 tree "
                             "(set tree=None)")
        with self.timer.time("controller"):
            count = chain.tokens.shape[1]
            self.round_lengths.append(count)
            last = self.reference.shape[1] - 1
            steps = torch.arange(1, count + 1, device=self.reference.device)
            index = (self.position.unsqueeze(1) + steps).clamp(max=last)  # rows past the end: any token
            truth = self.reference.gather(1, index)
            keep = torch.rand(truth.shape, generator=self.generator, device=truth.device) < self.alpha
            shift = torch.randint(1, self.token_limit, truth.shape, generator=self.generator, device=truth.device)
            wrong = (truth % self.token_limit + shift) % self.token_limit  # never equals the truth
            return DraftChain(torch.where(keep, truth, wrong).to(chain.tokens.dtype), None)

    def commit(self, result: RoundResult) -> None:
        with self.timer.time("draft", "commit"):
            self.inner.commit(result)
        with self.timer.time("controller"):
            self.position = self.position + result.num_accepted + 1
            index = self.position.clamp(max=self.reference.shape[1] - 1).unsqueeze(1)
            expected = self.reference.gather(1, index).squeeze(1)
            inside = self.position < self.reference.shape[1]
            self.mismatch_count = self.mismatch_count + ((result.next_tokens != expected) & inside).sum()
