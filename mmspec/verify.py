"""Chain verification: which drafted tokens to keep, and the one token the target adds.

``verify_tokens`` is the single accept/reject decision point for chain drafts in the project (trees go
through :mod:`mmspec.tree`, continuous tokens through :mod:`mmspec.continuous`). It is batched: every
row has its own accepted length.

Distributions with a NaN, infinite, negative or all-zero row raise
:class:`~mmspec.validation.NonFiniteProbabilitiesError` naming the distribution ("target distribution",
"draft distribution") and the row: at the entry while value checks are on; with them off (the decoding
loops), when the token drawn at the end of the chain comes from such a row (a NaN row rejects every draft,
see :mod:`mmspec.rules`), or before the fused kernel runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mmspec import kernels
from mmspec.rules import AcceptanceRule, ExactRule, GreedyRule
from mmspec.sampling import draw, draw_uniforms, top_token
from mmspec.validation import (
    NonFiniteProbabilitiesError,
    blame_inputs,
    check_ndim,
    check_probability_rows,
    check_probs,
    check_token_ids,
    checks_enabled,
    positive_and_finite,
    value_checks,
)

#: How errors name the two distributions of a chain.
TARGET_NAME, DRAFT_NAME = "target distribution (target_probs)", "draft distribution (draft_probs)"


@dataclass
class Verification:
    """Result of verifying ``K`` drafted tokens per row.

    Attributes:
        num_accepted: LongTensor ``[B]``, how many drafts each row keeps (0..K).
        tokens: LongTensor ``[B, K+1]``: the accepted drafts, then one corrected (at the first
            rejection) or bonus (all accepted) token, then ``-1`` padding. A caller commits
            ``tokens[b, : num_accepted[b] + 1]``.
    """

    num_accepted: torch.Tensor
    tokens: torch.Tensor
    _accepted_counts: list[int] | None = field(default=None, repr=False, compare=False)

    def accepted_counts(self) -> list[int]:
        """``num_accepted`` on the host (read once; a greedy chain's verification has it there already)."""
        if self._accepted_counts is None:
            self._accepted_counts = self.num_accepted.tolist()
        return self._accepted_counts

    @property
    def num_emitted(self) -> torch.Tensor:
        """Tokens each row gains from this verification: accepted drafts plus one (``[B]``)."""
        return self.num_accepted + 1


def check_chain_inputs(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                       target_probs: torch.Tensor, rule: AcceptanceRule) -> tuple[int, int, int]:
    """Validate the arguments of :func:`verify_tokens`; returns ``(B, K, V)``."""
    if not isinstance(rule, AcceptanceRule):
        raise ValueError(f"rule must be an AcceptanceRule (ExactRule(), GreedyRule(), ...), got {rule!r}")
    check_ndim(draft_tokens, 2, "draft_tokens", "[B, K]")
    check_ndim(target_probs, 3, "target_probs", "[B, K+1, V]")
    batch, num_draft = draft_tokens.shape
    if num_draft == 0:
        raise ValueError("draft_tokens has K=0 drafted tokens; sample from target_probs directly instead")
    vocab = target_probs.shape[-1]
    if target_probs.shape[:2] != (batch, num_draft + 1):
        raise ValueError(f"target_probs must have shape [B, K+1, V] = [{batch}, {num_draft + 1}, V] for "
                         f"draft_tokens {tuple(draft_tokens.shape)}, got {tuple(target_probs.shape)}")
    check_probs(target_probs, TARGET_NAME)
    if draft_probs is not None:
        check_ndim(draft_probs, 3, "draft_probs", "[B, K, V]")
        if draft_probs.shape[-1] != vocab:
            raise ValueError(f"vocab mismatch: draft_probs has {draft_probs.shape[-1]} entries per position, "
                             f"target_probs has {vocab}")
        if draft_probs.shape[:2] != (batch, num_draft):
            raise ValueError(f"draft_probs must have shape [B, K, V] = [{batch}, {num_draft}, {vocab}], "
                             f"got {tuple(draft_probs.shape)}")
        check_probs(draft_probs, DRAFT_NAME)
    check_token_ids(draft_tokens, vocab, "draft_tokens")
    rule.check_vocab(vocab)
    return batch, num_draft, vocab


def verify_tokens(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                  rule: AcceptanceRule = ExactRule(), generator: torch.Generator | None = None) -> Verification:
    """Verify a chain of drafted tokens against the target, batched.

    Args:
        draft_tokens: LongTensor ``[B, K]``.
        draft_probs: ``[B, K, V]``, the distribution each draft was sampled from, or None for
            deterministic drafts (q is a point mass at the draft).
        target_probs: ``[B, K+1, V]``; position i is the target's distribution for draft i, position K
            gives the bonus token.
        rule: the acceptance rule (:class:`ExactRule` is lossless).
        generator: source of the uniforms (``[B, K]`` acceptance draws, then ``[B]`` sampling draws).
    Returns:
        :class:`Verification`.
    """
    batch, num_draft, _ = check_chain_inputs(draft_tokens, draft_probs, target_probs, rule)
    fused = rule.fused_kernel is not None and kernels.kernel_backend(target_probs) == "triton"
    if not fused and type(rule) is GreedyRule and draft_probs is None:
        return _verify_greedy_chain(draft_tokens, target_probs)
    accept_u = draw_uniforms((batch, num_draft), target_probs, generator)
    sample_u = draw_uniforms((batch,), target_probs, generator)

    if fused:
        if not checks_enabled():  # the kernel's draws cannot refuse a bad row: check the rows' totals first
            _check_row_totals(target_probs, draft_probs)
        num_accepted, next_tokens = kernels.chain_verify(draft_tokens, draft_probs, target_probs, accept_u,
                                                         sample_u, greedy=rule.fused_kernel == "greedy",
                                                         check_values=False)
    else:
        with value_checks(False):  # checked above: the rule need not scan the rows again
            num_accepted, next_tokens = _verify_chain_torch(draft_tokens, draft_probs, target_probs, rule,
                                                            accept_u, sample_u)
    return Verification(num_accepted, assemble_tokens(draft_tokens, num_accepted, next_tokens))


def _check_row_totals(target_probs: torch.Tensor, draft_probs: torch.Tensor | None) -> None:
    """Refuse NaN, infinite and all-zero rows of the chain's distributions from their totals (one reduction
    each and one host read in all); the full scan that names the row runs only after a failure."""
    totals = target_probs.sum(-1).flatten()
    if draft_probs is not None:
        totals = torch.cat([totals, draft_probs.sum(-1).flatten()])
    if not positive_and_finite(totals):
        _raise_bad_input(target_probs, draft_probs)


def _raise_bad_input(target_probs: torch.Tensor, draft_probs: torch.Tensor | None) -> None:
    """Raise naming the first bad row of the target, else of the draft distribution (one of them has one)."""
    check_probability_rows(target_probs, TARGET_NAME)
    if draft_probs is not None:
        check_probability_rows(draft_probs, DRAFT_NAME)
    raise AssertionError("a bad row was detected but not found")  # unreachable: the scans see what totals see


def _verify_greedy_chain(draft_tokens: torch.Tensor, target_probs: torch.Tensor) -> Verification:
    """Greedy rule, deterministic drafts: the target's argmax at every position decides everything.

    The same decisions as the reference path (a draft is kept while it is the target's argmax; the next
    token is the argmax at the first mismatch, or the bonus position), decided on the host from one read
    of the argmaxes and the drafts, without drawing the uniforms that path ignores for this rule: it runs
    once per round of every greedy chain, right after the target's forward, where each small tensor
    operation costs several times its isolated time (cold caches), and a chain is a few tokens per row.
    Rows whose maximum is not a positive finite number (NaN, all zero) raise: the maxima are read with the
    argmaxes and compared on the host."""
    top, best = top_token(target_probs)  # [B, K+1]; a NaN row's maximum is NaN
    best = best.tolist()
    if not positive_and_finite(top):
        _raise_bad_input(target_probs, None)
    rows, counts = [], []
    for row_best, row_drafts in zip(best, draft_tokens.tolist()):
        count = 0
        while count < len(row_drafts) and row_drafts[count] == row_best[count]:
            count += 1
        counts.append(count)
        rows.append(row_drafts[:count] + [row_best[count]] + [-1] * (len(row_drafts) - count))
    device = draft_tokens.device
    return Verification(torch.tensor(counts, device=device), torch.tensor(rows, device=device), counts)


def _verify_chain_torch(draft_tokens, draft_probs, target_probs, rule, accept_u, sample_u):
    """Reference path for any rule: ``(num_accepted [B], next_tokens [B])``."""
    batch, num_draft = draft_tokens.shape
    depths = torch.arange(1, num_draft + 1, device=draft_tokens.device) if rule.uses_depths else None
    target_mass, draft_mass = rule.masses_at(target_probs[:, :num_draft], draft_probs, draft_tokens, depths)  # [B, K]
    accepted = accept_u * draft_mass < target_mass
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # leading run of acceptances

    rows = torch.arange(batch, device=draft_tokens.device)
    at = num_accepted.clamp(max=num_draft - 1)  # first rejected position (clamped for all-accepted rows)
    weights = rule.residual(target_probs[rows, at], None if draft_probs is None else draft_probs[rows, at],
                            draft_tokens[rows, at])  # [B, V]
    all_accepted = (num_accepted == num_draft).unsqueeze(-1)
    weights = torch.where(all_accepted, target_probs[:, num_draft], weights)
    try:
        next_tokens = draw(weights, rule.greedy, uniforms=sample_u, name="residual")
    except NonFiniteProbabilitiesError as error:  # name the distribution the bad residual came from
        raise blame_inputs(error, (TARGET_NAME, target_probs), (DRAFT_NAME, draft_probs)) from None
    return num_accepted, next_tokens


def assemble_tokens(draft_tokens: torch.Tensor, num_accepted: torch.Tensor,
                    next_tokens: torch.Tensor) -> torch.Tensor:
    """``[B, K+1]``: accepted drafts, the next token at index ``num_accepted``, ``-1`` after it."""
    batch, num_draft = draft_tokens.shape
    positions = torch.arange(num_draft + 1, device=draft_tokens.device)
    padded = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), -1)], dim=1)
    tokens = torch.where(positions < num_accepted.unsqueeze(-1), padded, -1)
    return tokens.scatter_(1, num_accepted.unsqueeze(-1), next_tokens.unsqueeze(-1))


def verify_positions(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     rule: AcceptanceRule = ExactRule(), generator: torch.Generator | None = None
                     ) -> Verification:
    """Per-position verdicts that go on past a rejection: each position is verified on its own.

    Position i keeps ``draft_tokens[:, i]`` with probability ``min(1, p_i / q_i)`` (the rule's masses) and
    otherwise draws from the rule's residual at i, whatever happened at the positions before it: a chain of
    one draft per position, verified by :func:`verify_tokens` (rows ``B * K``, K = 1). Under
    :class:`ExactRule` each output token follows ``target_probs[:, i]`` exactly (and equals the draft with
    the largest probability a coupling allows, 1 - TV(p_i, q_i)). SJD-PAC's adaptive continuation re-verifies
    a window's tail this way against distributions the target computed under a context that a rejection
    then changed; the tail becomes the next round's drafts with those distributions as their q.

    Args:
        draft_tokens: LongTensor ``[B, K]``; draft_probs: ``[B, K, V]`` the laws they were drawn from (None:
            point masses); target_probs: ``[B, K, V]``, one distribution per position (no bonus position).
    Returns:
        :class:`Verification` with ``tokens [B, K]`` (the verdict of every position) and ``num_accepted [B]``
        (how many positions kept their draft, anywhere in the row).
    """
    check_ndim(draft_tokens, 2, "draft_tokens", "[B, K]")
    check_ndim(target_probs, 3, "target_probs", "[B, K, V]")
    batch, num_draft = draft_tokens.shape
    if target_probs.shape[:2] != (batch, num_draft):
        raise ValueError(f"target_probs must have shape [B, K, V] = [{batch}, {num_draft}, V] (one distribution "
                         f"per position), got {tuple(target_probs.shape)}")
    vocab = target_probs.shape[-1]
    flat_probs = target_probs.reshape(batch * num_draft, 1, vocab)
    flat_draft = None if draft_probs is None else draft_probs.reshape(batch * num_draft, 1, -1)
    chain = verify_tokens(draft_tokens.reshape(-1, 1), flat_draft, flat_probs.expand(-1, 2, -1), rule, generator)
    kept = chain.num_accepted.reshape(batch, num_draft)
    tokens = chain.tokens.gather(1, chain.num_accepted.unsqueeze(1)).reshape(batch, num_draft)
    tokens = torch.where(kept.bool(), draft_tokens, tokens)
    return Verification(kept.sum(-1), tokens)
