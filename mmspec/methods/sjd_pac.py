"""SJD-PAC (arXiv 2603.18599): speculative Jacobi decoding with Proactive Drafting and Adaptive Continuation.

Training-free and lossless, like SJD. Two changes to SJD's window (:class:`~mmspec.drafters.JacobiDrafter`):

* **Adaptive Continuation** (AC): after the first rejection, the corrected token is committed and the rest of
  the window is verified on, position by position, against the distributions the target computed this round
  (under the now rejected context): a draft that passes stays, a failed one is redrawn from its residual
  (:func:`~mmspec.verify.verify_positions`). Nothing past the first rejection is committed; the surviving
  tail, each slot with the target's distribution there as its q, becomes the next round's drafts, which the
  next round verifies again under the corrected context. On a chain this is SCD's coupled redraw.
* **Proactive Drafting** (PD): after a rejection, the first columns after the corrected token hold ``K``
  candidates instead of one: the tail's token and ``K - 1`` more drawn *without replacement* from the same
  cached distribution. The next round verifies a tree rooted at the corrected token: the first
  ``tree_depth - 1`` columns as a full K-ary tree (every node of a level has that column's K candidates as
  children), then one chain from the all-first-candidates path to the window length. No extra forward: the
  candidates come from the distributions the last round computed. Verification walks siblings in order
  (:func:`~mmspec.tree.verify_tree` with ``without_replacement=True``: each sibling tested against its own
  law, the residual carried on), which outputs the target exactly.

Why it is lossless: every candidate at an absolute position is drawn with fresh randomness from a law (its q)
that is a function of tokens and draws at earlier positions only, so when verification reaches the position
the candidates follow their q given everything verification has seen; exact (multi-draft) speculative
sampling then outputs the target's conditional there. The continuation's verdicts keep this: a verdict
follows the cached distribution exactly, which becomes its q. What the released code (commit 4fbc099) does
differently, and where that is not lossless, is in docs/official_code.md.

The pipeline provides the transformer (its ``config.vocab_size``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar

import torch

from mmspec.drafters import FRESH_Q, JacobiDrafter, one_hot_probs
from mmspec.methods.base import (
    BuildRequest,
    MethodPlan,
    check_bool_field,
    check_choice_field,
    check_int_field,
    register,
)
from mmspec.methods.jacobi import SJDConfig
from mmspec.rules import ExactRule
from mmspec.sampling import SamplingConfig, first_argmax, sample, sample_without_replacement
from mmspec.speculate import DraftChain, PrefillContext, RoundResult
from mmspec.tree import ROOT, DraftTree
from mmspec.validation import check_positive_int
from mmspec.verify import verify_positions

#: a continuation node that does not exist (the path left the tree: no cached distribution further on)
_GONE = -2


@lru_cache(maxsize=64)
def tree_layout(width: int, levels: int, k: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The proactive tree over ``width`` columns: ``(parents, columns, ranks)``, one entry per node.

    Columns ``0 .. levels-1`` form a full ``k``-ary tree (level by level; a parent's children contiguous, in
    candidate order), so node ``n`` of level ``c`` holds candidate ``ranks[n]`` of column ``c``; columns
    ``levels .. width-1`` are one chain (candidate 0) under the all-first-candidates node of the last level.
    ``levels=0`` is SJD's chain. Topologically ordered, as :class:`~mmspec.tree.DraftTree` needs.
    """
    parents: list[int] = []
    columns: list[int] = []
    ranks: list[int] = []
    level = [ROOT]
    for column in range(levels):
        nodes = []
        for parent in level:
            for rank in range(k):
                nodes.append(len(parents))
                parents.append(parent)
                columns.append(column)
                ranks.append(rank)
        level = nodes
    tail = level[0]
    for column in range(levels, width):
        parents.append(tail)
        columns.append(column)
        ranks.append(0)
        tail = len(parents) - 1
    return tuple(parents), tuple(columns), tuple(ranks)


class SJDPACDrafter(JacobiDrafter):
    """SJD-PAC's window: :class:`~mmspec.drafters.JacobiDrafter`'s slots (candidate 0 of every column, with
    its q), plus ``K - 1`` extra candidates for the first ``tree_depth - 1`` columns after a rejection.

    Args (beyond :class:`~mmspec.drafters.JacobiDrafter`'s ``vocab_size, window, sampling, init, token_range,
    generator, fresh_q``):
        tree_width: K, candidates per tree column (the paper's K; 1: no tree).
        tree_depth: D, the tree's depth counting its root (the corrected token), as the paper and the released
            code count it: ``D - 1`` columns of K candidates.
        proactive: draft the tree after a rejection (False: a chain every round).
        adaptive_continuation: verify the tail past a rejection against the cached distributions (False: SJD's
            independent redraw of every slot from them).

    The target's draw after the last draft is kept as a draft (``keep_last_draw``). Greedy decoding takes the
    cached distributions' top-K tokens as candidates. In a batch, columns align across rows: a round keeps as
    many columns as the row with the most cached ones, the other rows filling theirs with fresh slots, and the
    tree is drafted when some row has a cached column.
    """

    def __init__(self, vocab_size: int, window: int = 16, sampling: SamplingConfig = SamplingConfig(do_sample=False),
                 init: str = "random", token_range: tuple[int, int] | None = None,
                 generator: torch.Generator | None = None, *, tree_width: int = 4, tree_depth: int = 3,
                 proactive: bool = True, adaptive_continuation: bool = True, fresh_q: str = "uniform") -> None:
        super().__init__(vocab_size, window, sampling, init, token_range, generator, coupled=adaptive_continuation,
                         keep_last_draw=True, fresh_q=fresh_q)
        check_positive_int(tree_width, "tree_width")
        check_positive_int(tree_depth, "tree_depth")
        if tree_width > self.high - self.low:
            raise ValueError(f"tree_width={tree_width} exceeds the {self.high - self.low} tokens candidates are "
                             "drawn from")
        self.tree_width = tree_width
        self.levels = tree_depth - 1 if proactive and tree_width > 1 else 0
        self.adaptive_continuation = bool(adaptive_continuation)
        self._extras: torch.Tensor | None = None  # [B, T, K-1] extra candidates of the first T columns
        self._layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # the last proposal's
        self._levels = 0  # the last proposal's tree columns
        self._layouts: dict[tuple[int, int, torch.device], tuple[torch.Tensor, ...]] = {}

    def prefill(self, context: PrefillContext) -> None:
        super().prefill(context)
        self._extras = None

    def propose(self, pending: torch.Tensor) -> DraftChain | DraftTree:
        width = self.capped(self.window)
        levels = 0 if self._extras is None else min(self._extras.shape[1], width)
        key = (width, levels, pending.device)
        if key not in self._layouts:  # a few shapes per call: built once each
            self._layouts[key] = tuple(torch.tensor(values, device=pending.device)
                                       for values in tree_layout(width, levels, self.tree_width))
        parents, columns, ranks = self._layouts[key]
        self._layout, self._levels = (parents, columns, ranks), levels
        probs = self._probs[:, :width] if self.sampling.do_sample else None
        if levels == 0:
            return DraftChain(self._tokens[:, :width].clone(), probs)
        batch = pending.shape[0]
        candidates = self._tokens[:, :width].unsqueeze(-1).expand(-1, -1, self.tree_width).clone()  # [B, W, K]
        candidates[:, :levels, 1:] = self._extras[:, :levels]
        tokens = candidates.reshape(batch, -1)[:, columns * self.tree_width + ranks]
        draft_probs = None if probs is None else probs[:, columns]
        return DraftTree(tokens, parents.expand(batch, -1), draft_probs, without_replacement=probs is not None)

    def commit(self, result: RoundResult) -> None:
        if result.target_probs is None:
            raise ValueError("SJDPACDrafter needs the round's target distributions")
        parents, columns, ranks = self._layout
        width = int(columns.max()) + 1
        device = result.num_accepted.device
        follow = self._continuation(result, parents, columns, ranks)  # [B, W]: node of each column, or _GONE
        # New column j is old column c = emitted + j; its distribution is the target's after the node at c - 1
        # on the continuation path (c = width: the position after the last draft, a free draw).
        emitted = result.num_accepted + 1
        old = emitted.unsqueeze(1) + torch.arange(width, device=device)  # [B, W] (at most W new columns)
        before = follow.gather(1, (old - 1).clamp(max=width - 1))
        cached = (old <= width) & (before != _GONE)
        counts = cached.long().cumprod(1).sum(1)  # [B] cached columns per row
        keep = int(counts.max())
        # Every row keeps its cached columns; a row with fewer fills the rest of the kept ones with fresh slots
        # (their own law), so no row loses cached columns to align with another.
        valid = torch.arange(keep, device=device) < counts.unsqueeze(1)  # [B, J]
        old, before = old[:, :keep], torch.where(valid, before[:, :keep], ROOT)
        vocab = result.target_probs.shape[-1]
        target = result.target_probs.gather(1, (before + 1).unsqueeze(-1).expand(-1, -1, vocab)).to(self._dtype)
        tokens = self._redraw(old, target, follow, width)
        if not bool(valid.all()):
            tokens, target = self._fresh_where(~valid, tokens, target, counts, result.next_tokens)
        self._tokens = tokens
        self._probs = target if self.sampling.do_sample else None
        self._fill(result.next_tokens)
        # a tree after a rejection (some row kept a cached column); tree columns without a cached distribution draw
        # their candidates from their fresh slot's law (a point mass gives repeats, which verification skips,
        # but the tree still gives every sibling of the columns before children to continue on)
        levels = min(self.levels, self.window) if keep else 0
        self._extras = self._extra_candidates(levels, target) if levels else None

    def _fresh_where(self, fresh: torch.Tensor, tokens: torch.Tensor, target: torch.Tensor, counts: torch.Tensor,
                     next_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens [B, J]`` and their q ``target [B, J, V]`` with the entries marked in ``fresh [B, J]`` (a row's
        columns past its ``counts`` cached ones) replaced by fresh slots as :meth:`_fill` makes them: uniform
        draws (q uniform, or one-hot with ``fresh_q="one_hot"``), or copies of the row's last kept token (the
        pending one when it kept none) with one-hot q."""
        batch, keep = tokens.shape
        if self.init == "random" and self.sampling.do_sample:
            law = self._uniform(batch, keep, tokens)
            drawn = sample(law, self.generator)
            if self.fresh_q == "one_hot":
                law = one_hot_probs(drawn, self.vocab_size).to(self._dtype)
        else:
            last = tokens.gather(1, (counts - 1).clamp(min=0, max=keep - 1).unsqueeze(1)).squeeze(1)
            drawn = torch.where(counts > 0, last, next_tokens).unsqueeze(1).expand(batch, keep)
            law = one_hot_probs(drawn, self.vocab_size).to(self._dtype) if self.sampling.do_sample else target
        return torch.where(fresh, drawn, tokens), torch.where(fresh.unsqueeze(-1), law, target)

    def _continuation(self, result: RoundResult, parents: torch.Tensor, columns: torch.Tensor,
                      ranks: torch.Tensor) -> torch.Tensor:
        """``[B, W]``: the node of each column on the accepted path, then, past it, the first candidate child of
        the node before (the slots the continuation verifies on; the round never tested them). A leaf of the
        tree's last level other than the all-first one has the chain's head as its first child: the chain's
        distributions stay exact drafting laws for any row (they depend on earlier columns' drafts only), so a
        path through other siblings still continues on the chain. ``_GONE`` past the window (never else)."""
        batch, device = result.num_accepted.shape[0], result.num_accepted.device
        nodes, width = parents.shape[0], int(columns.max()) + 1
        first_child = torch.full((nodes + 2,), _GONE, dtype=torch.long, device=device)  # rows: root, nodes, gone
        order = torch.arange(nodes, device=device)
        is_first = ranks == 0
        first_child[(parents[is_first] + 1)] = order[is_first]
        levels = self._levels
        if levels and width > levels:  # a tree with a chain under it: every leaf continues on it
            head = order[columns == levels][0]
            leaves = order[(columns == levels - 1) & (first_child[1:nodes + 1] == _GONE)]
            first_child[leaves + 1] = head
        if result.path is not None:
            path = result.path
        else:  # a chain: node c is column c
            path = torch.arange(width, device=device).expand(batch, -1)
        current = torch.full((batch,), ROOT, dtype=torch.long, device=device)
        follow = []
        for column in range(width):
            child = first_child[torch.where(current == _GONE, nodes + 1, current + 1)]
            on_path = path[:, column] if column < path.shape[1] else child
            current = torch.where(column < result.num_accepted, on_path, child)
            follow.append(current)
        return torch.stack(follow, 1)

    def _redraw(self, old: torch.Tensor, target: torch.Tensor, follow: torch.Tensor, width: int) -> torch.Tensor:
        """Candidate 0 of each kept column ``[B, J]``: the verdict on the old candidate 0 there when AC is on
        and one exists (the column's first candidate child on the continuation path), else a fresh draw from
        ``target [B, J, V]`` (its argmax when greedy)."""
        if not self.sampling.do_sample:
            return first_argmax(target)
        fresh = sample(target, self.generator, name="target distribution")
        if not self.adaptive_continuation or old.shape[1] == 0:
            return fresh
        index = old.clamp(max=width - 1)
        has_old = (old < width) & (follow.gather(1, index) != _GONE)
        tokens = self._tokens.gather(1, index)
        q = self._probs.gather(1, index.unsqueeze(-1).expand(-1, -1, target.shape[-1]))
        verdict = verify_positions(tokens, q, target, ExactRule(), self.generator).tokens
        return torch.where(has_old, verdict, fresh)

    def _extra_candidates(self, levels: int, cached: torch.Tensor) -> torch.Tensor:
        """``[B, T, K-1]`` candidates 1..K-1 of the first ``T = levels`` columns: drawn without replacement
        from the column's q given candidate 0 (which follows q), so all K follow successive sampling without
        replacement from q, the law the tree's verification assumes (a point-mass q, a "left" or "one_hot"
        fresh slot, gives repeats, which verification skips). Greedy: the next best tokens of the cached
        distributions ``cached [B, J, V]`` (any other tokens in fresh columns)."""
        first = self._tokens[:, :levels].unsqueeze(-1)
        if self.sampling.do_sample:
            return sample_without_replacement(self._probs[:, :levels], self.tree_width - 1, self.generator,
                                              exclude=first, name="target distribution")
        scores = cached.new_zeros(first.shape[0], levels, self.vocab_size)
        known = min(levels, cached.shape[1])
        scores[:, :known] = cached[:, :known]
        return scores.scatter(-1, first, -1.0).topk(self.tree_width - 1, dim=-1).indices


@register("sjd_pac")
@dataclass(frozen=True)
class SJDPACConfig(SJDConfig):
    """SJD-PAC (lossless): SJD's window with Proactive Drafting and Adaptive Continuation.

    Attributes:
        window: columns verified per round (the main path's length).
        init: how fresh slots are filled: "random" (uniform tokens) or "left" (a copy of the slot before).
        tree_width: K, candidates per tree column (the paper's default 4; the released code's 3).
        tree_depth: D, the tree's depth counting its root, the corrected token (the paper's 3: two columns of K).
        proactive: Proactive Drafting on (False: a chain every round).
        adaptive_continuation: Adaptive Continuation on (False: SJD's independent redraws).
        fresh_q: the q of fresh random slots ("uniform" or "one_hot"), see :class:`~mmspec.drafters.JacobiDrafter`.
    """

    pipelines: ClassVar[tuple[str, ...]] = ("ar_image",)

    tree_width: int = 4
    tree_depth: int = 3
    proactive: bool = True
    adaptive_continuation: bool = True
    fresh_q: str = "uniform"

    def validate(self) -> None:
        super().validate()
        check_int_field(self, "tree_width", 1, 64)
        check_int_field(self, "tree_depth", 1, 8)
        check_bool_field(self, "proactive")
        check_bool_field(self, "adaptive_continuation")
        check_choice_field(self, "fresh_q", FRESH_Q)
        if self.proactive and self.tree_depth - 1 > self.window:
            raise ValueError(f"SJDPACConfig.tree_depth must be at most window + 1 = {self.window + 1}, "
                             f"got {self.tree_depth}")

    def drafter(self, pipeline: Any, request: BuildRequest) -> SJDPACDrafter:
        return SJDPACDrafter(int(pipeline.transformer.config.vocab_size), window=self.window,
                             sampling=request.sampling, init=self.init, generator=request.generator,
                             tree_width=self.tree_width, tree_depth=self.tree_depth, proactive=self.proactive,
                             adaptive_continuation=self.adaptive_continuation, fresh_q=self.fresh_q)

    def build(self, pipeline: Any, request: BuildRequest) -> MethodPlan:
        return MethodPlan(drafter=self.drafter(pipeline, request))
