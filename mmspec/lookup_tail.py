"""Free draft tokens after a drafter's chain: copies of earlier tokens of the same row (a lookup tail).

A feature-level drafter pays a forward per draft (or per block of drafts), and it ends its chain at K
drafts or where it is unsure. Verifying one more position costs the target only that position's
arithmetic, so a draft that needs no drafter forward pays off wherever it is right often enough.
Raster-order images have such drafts: the token one grid row above (``offset`` = the grid width),
inside a region of one code (an image's background). A tail token ``q`` of a row's generated sequence
is a copy of token ``q - offset`` (the chain's own drafts and earlier tail tokens count), and with
``stop_at_change`` (the default) the tail ends before the first copy that differs from the token before
it: the tail runs on while "above" and "left" agree and stops at an edge, where a copy is mostly wrong.
On the shapes zoo one EAGLE block plus a tail is the fastest greedy setting measured
(docs/pipeline_ar_image.md, "Lookup tails").

Tail tokens are point-mass proposals, so verification stays exact: greedy decoding keeps the target's
tokens, and exact sampling accepts a tail token ``x`` with probability ``p(x)`` and redraws from the
residual (``p`` without ``x``), as for any deterministic draft. The inner drafter sees every round's
result unchanged (accepted tail tokens are committed tokens like its own accepted drafts).
"""

from __future__ import annotations

import torch

from mmspec.drafters import one_hot_probs
from mmspec.speculate import DraftChain, Drafter, PrefillContext, RoundResult
from mmspec.tree import DraftTree
from mmspec.validation import check_positive_int


def lookup_tail(sequence: list[int], length: int, offset: int, stop_at_change: bool = True) -> list[int]:
    """Up to ``length`` tokens that follow ``sequence``, token ``q`` a copy of token ``q - offset`` (tail
    tokens included), or of token ``q - 1`` while ``q - offset`` precedes the sequence. ``stop_at_change``:
    end before the first copy that differs from the token before it (``sequence`` must not be empty)."""
    extended = list(sequence)
    for _ in range(length):
        position = len(extended)
        copy = extended[position - offset] if position >= offset else extended[position - 1]
        if stop_at_change and copy != extended[position - 1]:
            break
        extended.append(copy)
    return extended[len(sequence):]


class LookupTailDrafter(Drafter):
    """``inner``'s chains, each followed by a lookup tail of up to ``length`` tokens (:func:`lookup_tail`).

    Args:
        inner: any drafter that proposes chains (an EAGLE head's, a draft model's); a tree is refused.
        length: the longest tail per round (>= 1).
        offset: how far back each tail token is copied from (an image's grid width: the token above).
        vocab_size: the target's vocabulary, for the tail's point-mass distributions when the inner chain
            is sampled (its ``probs`` are extended with them).
        stop_at_change: end a row's tail at its first copy that differs from the token before it (default);
            False always appends ``length`` tokens.
        lookup_only_from: a round whose tail, read from the committed tokens before drafting, has at least
            this many tokens proposes that tail alone and skips the inner drafter (its forward), which then
            learns the round through ``commit_undrafted`` (:class:`~mmspec.models.eagle.EagleDrafter` has it).
            One row per call only: with several rows the inner drafter drafts every round. None (default):
            never.
        max_length: tokens a row generates in all (an image's token count): no tail position reaches past it,
            where a verified draft would be thrown away. None: no limit.

    Rows of one round share a chain length: when rows' tails end at different lengths, the shorter ones
    are continued with plain copies up to the longest (wasted positions at batch > 1, where verification
    is compute-bound anyway and a tail tends to cost more than it gains). Every row's generated tokens are
    kept on the host (a few Python ints per round), since tails are read from them.
    """

    def __init__(self, inner: Drafter, length: int, offset: int, vocab_size: int, stop_at_change: bool = True,
                 lookup_only_from: int | None = None, max_length: int | None = None) -> None:
        if not isinstance(inner, Drafter):
            raise ValueError(f"inner must be a Drafter, got {type(inner).__name__}")
        check_positive_int(length, "length")
        check_positive_int(offset, "offset")
        check_positive_int(vocab_size, "vocab_size")
        self.inner, self.length, self.offset, self.vocab_size = inner, length, offset, vocab_size
        self.stop_at_change = stop_at_change
        if lookup_only_from is not None:
            check_positive_int(lookup_only_from, "lookup_only_from")
            if not inner.can_skip_rounds:
                raise ValueError(f"lookup_only_from needs an inner drafter that can skip rounds (commit_undrafted); "
                                 f"{type(inner).__name__} cannot")
        self.lookup_only_from = lookup_only_from
        if max_length is not None:
            check_positive_int(max_length, "max_length")
        self.max_length = max_length
        self._undrafted = False  # whether the current round is lookup-only
        self.needs_target_hidden = inner.needs_target_hidden
        self.target_hidden = inner.target_hidden  # the target features the inner drafter reads under guidance
        self._generated: list[list[int]] = []  # per row: generated tokens, the pending one last
        self._proposed: list[list[int]] = []  # per row: the round's chain then its tail

    @property
    def calls(self) -> int:
        return self.inner.calls

    def prefill(self, context: PrefillContext) -> None:
        self.inner.prefill(context)
        self._generated = [[token] for token in context.first_tokens.tolist()]

    def propose(self, pending: torch.Tensor) -> DraftChain:
        self._undrafted = False
        if self.lookup_only_from is not None and len(self._generated) == 1:  # one row: may skip the inner drafter
            tail = lookup_tail(self._generated[0], self._room(self._generated[0]), self.offset, self.stop_at_change)
            if len(tail) >= self.lookup_only_from:  # the round starts inside a long run of one code
                self._undrafted, self._proposed = True, [tail]
                return DraftChain(torch.tensor([tail], dtype=pending.dtype, device=pending.device))  # point masses
        self.inner.draft_limit = self.draft_limit  # the inner chain and the tail share the round's cap
        chain = self.inner.propose(pending)
        if isinstance(chain, DraftTree):
            raise ValueError("a lookup tail extends draft chains; the inner drafter proposed a tree "
                             "(draft chains, e.g. tree=None, to use a tail)")
        drafts = chain.tokens.tolist()
        rows = [generated + row for generated, row in zip(self._generated, drafts)]
        tails = [lookup_tail(row, self._room(row, already=chain.tokens.shape[1]), self.offset, self.stop_at_change)
                 for row in rows]
        width = max(len(tail) for tail in tails)
        if min(len(tail) for tail in tails) < width:  # rows whose tail ended early go on copying
            tails = [lookup_tail(row, width, self.offset, stop_at_change=False) for row in rows]
        self._proposed = [row + tail for row, tail in zip(drafts, tails)]
        if width == 0:
            return chain
        tail_tokens = torch.tensor(tails, dtype=chain.tokens.dtype, device=chain.tokens.device)
        probs = chain.probs
        if probs is not None:
            probs = torch.cat([probs, one_hot_probs(tail_tokens, self.vocab_size).to(probs.dtype)], 1)
        return DraftChain(torch.cat([chain.tokens, tail_tokens], 1), probs)

    def _room(self, sequence: list[int], already: int = 0) -> int:
        """The longest tail after ``sequence``: ``length``, cut where it would pass ``max_length`` and to what
        the round's :attr:`draft_limit` leaves after ``already`` drafted tokens."""
        room = self.length if self.max_length is None else min(self.length, self.max_length - len(sequence))
        return max(0, self.capped(already + room) - already)

    def commit(self, result: RoundResult) -> None:
        if self._undrafted:
            self.inner.commit_undrafted(result)
        else:
            self.inner.commit(result)
        for generated, proposed, accepted, token in zip(self._generated, self._proposed, result.num_accepted_list(),
                                                        result.next_tokens.tolist()):
            generated.extend(proposed[:accepted])
            generated.append(token)
