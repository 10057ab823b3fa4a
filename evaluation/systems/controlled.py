"""Controlled acceptance: the method's real drafter runs, but what it proposes is accepted with a known rate.

Acceptance depends on trained weights; the efficiency of a loop does not. :class:`ControlledDrafter` wraps the
drafter a method builds and calls it exactly as the loop would (its forwards, cache updates and rollbacks
are the product's, and so is their time), then replaces the tokens it proposed: each is the target's own
greedy continuation at that position, kept with probability ``alpha`` and otherwise replaced by another
token, independently. Under greedy verification a chain of K drafts then keeps a geometric prefix, so the
mean tokens per round (accepted drafts plus the target's token) is known in advance:
:func:`expected_tau`. A draft tree (EAGLE-2) keeps its shape, and its nodes' tokens are replaced so that one
path can carry the continuation: at each depth the first child of the node that carries it is the target's
token with probability ``alpha``, every other node a different token. A tree of depth D then accepts like a
chain of D drafts, while its verification costs what the whole tree costs.

The greedy continuation (``reference``) comes from the target-only run of the same inputs, which the
benchmark runs first anyway as its baseline. Where the speculative run's greedy tokens differ from it
(float rounding of a wider forward flipping a near-tie), later drafts follow the wrong continuation; the
wrapper counts such positions (:attr:`ControlledDrafter.mismatches`) so a report can show they are rare.
"""

from __future__ import annotations

import dataclasses

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
        inner: the drafter the method built (chains or trees).
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
        self.round_lengths: list[int] = []  # drafted tokens (tree nodes) per round
        self.round_depths: list[int] = []  # drafted levels per round (a chain's length, a tree's depth)

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

    def propose(self, pending: torch.Tensor) -> DraftChain | DraftTree:
        with self.timer.time("draft", "propose"):
            self.inner.draft_limit = self.draft_limit
            proposal = self.inner.propose(pending)
        with self.timer.time("controller"):
            if isinstance(proposal, DraftTree):
                return self._controlled_tree(proposal)
            count = proposal.tokens.shape[1]
            self.round_lengths.append(count)
            self.round_depths.append(count)
            steps = torch.arange(1, count + 1, device=self.reference.device).expand(proposal.tokens.shape[0], count)
            truth = self._truth(steps)
            keep = torch.rand(truth.shape, generator=self.generator, device=truth.device) < self.alpha
            return DraftChain(torch.where(keep, truth, self._wrong(truth)).to(proposal.tokens.dtype), None)

    def _truth(self, steps: torch.Tensor) -> torch.Tensor:
        """``[B, N]`` the reference token ``steps`` positions after each row's pending one (rows past the end:
        the last reference token, any token would do)."""
        index = (self.position.unsqueeze(1) + steps).clamp(max=self.reference.shape[1] - 1)
        return self.reference.gather(1, index)

    def _wrong(self, truth: torch.Tensor) -> torch.Tensor:
        """A token below ``token_limit`` that differs from ``truth``, per element."""
        shift = torch.randint(1, self.token_limit, truth.shape, generator=self.generator, device=truth.device)
        return (truth % self.token_limit + shift) % self.token_limit

    def _controlled_tree(self, tree: DraftTree) -> DraftTree:
        depths = tree.depths()
        max_depth = int(depths.max())
        self.round_lengths.append(tree.num_nodes)
        self.round_depths.append(max_depth)
        truth = self._truth(depths)
        keep = torch.rand((truth.shape[0], max_depth), generator=self.generator, device=truth.device) < self.alpha
        node = torch.arange(tree.num_nodes, device=truth.device)
        carries = torch.zeros_like(truth, dtype=torch.bool)  # the node is the continuation so far
        for depth in range(1, max_depth + 1):  # parents come first: depth by depth
            parent_carries = (tree.parents < 0) | carries.gather(1, tree.parents.clamp(min=0))
            candidates = (depths == depth) & parent_carries
            first = torch.where(candidates, node, tree.num_nodes).min(dim=1, keepdim=True).values
            carries |= (node == first) & keep[:, depth - 1:depth]
        tokens = torch.where(carries, truth, self._wrong(truth)).to(tree.tokens.dtype)
        return dataclasses.replace(tree, tokens=tokens)  # the tree's other facts (how siblings were drawn) stay

    def commit(self, result: RoundResult) -> None:
        with self.timer.time("draft", "commit"):
            self.inner.commit(result)
        with self.timer.time("controller"):
            self.position = self.position + result.num_accepted + 1
            index = self.position.clamp(max=self.reference.shape[1] - 1).unsqueeze(1)
            expected = self.reference.gather(1, index).squeeze(1)
            inside = self.position < self.reference.shape[1]
            self.mismatch_count = self.mismatch_count + ((result.next_tokens != expected) & inside).sum()
