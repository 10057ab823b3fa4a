"""Block-wise speculative decoding with local 2-D rejection (MuLo-SD, arXiv 2601.05149).

Raster speculative decoding truncates at the first rejected token. MuLo-SD instead drafts whole
blocks of image rows, lets the target score every drafted token in one pass, and redraws only the
radius-l square neighbourhoods around rejected tokens; the rest of the block stands. This module is
the model-agnostic loop: any :class:`RowBlockDrafter` (MuLo-SD's low-resolution drafter + up-sampler,
or anything else that proposes rows) with any :class:`~mmspec.rules.AcceptanceRule` (pooled threshold,
LANTERN, exact...).

One round for block b (``block_rows`` grid rows of ``width`` tokens):

1. the drafter proposes the block's ``block_rows * width`` tokens;
2. the target runs once over the tokens of block b-1 that changed after its verification (from the
   first changed column on, so its cache holds what was finally kept) followed by the draft of block b;
   the logits give p_i for every drafted token;
3. each token is accepted by the rule (``u * draft_mass < target_mass``); rejections grow to
   radius-``radius`` squares inside the block (:func:`~mmspec.local2d.local_resample_sets`);
4. tokens in the grown set are redrawn. ``resample="parallel"`` (the paper's local resampling) draws
   them all from the target's distributions of this pass (rejected tokens from the rule's residual,
   their accepted neighbours from p), although each of those distributions saw the *drafts* around
   it. ``resample="sequential"`` draws them in raster order, each from the target given the final
   tokens before it (one more target call per redrawn column after the first), so a redrawn token
   never conditions on a rejected draft; with every draft rejected it is target-only decoding.
   Either way, accepted tokens after a redrawn one keep their verification, which saw the old
   neighbour: the method is lossy by design (quality is reported next to speed).
   ``resample="reverify"`` replaces steps 3-4 by raster-order speculative decoding over the drafted
   block: per row, drafts are kept up to the first rejection, which is redrawn from the rule's residual,
   the drafts after it are replaced by the target's proposals from that pass (Jacobi refinement) and
   verified by another pass over the final tokens (no neighbourhoods, ``radius`` unused). Every decision
   sees final tokens only, so with an exact rule the output is distributed as target-only decoding
   whatever the drafts.

In the parallel mode each block costs one target forward (plus the rewrite of its changed suffix,
merged into the next block's pass), so an H-row image takes ``H / block_rows`` target calls after the
prefill.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mmspec.local2d import local_resample_sets
from mmspec.rules import AcceptanceRule
from mmspec.sampling import SamplingConfig, draw_uniforms
from mmspec.sampling import draw as draw_tokens
from mmspec.speculate import Target, default_rule, target_probs_fn
from mmspec.stats import SpecStats
from mmspec.validation import NonFiniteProbabilitiesError, blame_inputs, check_positive_int, value_checks

#: How rejected drafts of a verified block are replaced (module docstring).
RESAMPLE_MODES = ("parallel", "sequential", "reverify")


class RowBlockDrafter(ABC):
    """Proposes whole blocks of grid rows (the drafter side of :func:`local_speculative_generate`).

    It declares the target features it reads as a token :class:`~mmspec.speculate.Drafter` does, so a pipeline
    builds the target runner for either kind the same way.
    """

    #: whether the drafter wants the target's top hidden states
    needs_target_hidden: bool = False
    #: under classifier-free guidance, which hidden states it reads (see :class:`~mmspec.speculate.Drafter`)
    target_hidden: str = "cond"

    @property
    def calls(self) -> int:
        """Draft forward passes so far (for :class:`SpecStats`)."""
        return 0

    @abstractmethod
    def prefill(self, attention_mask: torch.Tensor | None, **model_inputs: Any) -> None:
        """Read the prompt (the same model inputs the target's prefill got)."""

    @abstractmethod
    def propose(self, block_index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft block ``block_index``: tokens ``[B, rows * width]`` (raster order inside the block) and
        the distributions they were drawn from ``[B, rows * width, V]`` (None: deterministic drafts)."""

    @abstractmethod
    def commit(self, block_index: int, tokens: torch.Tensor) -> None:
        """The final tokens ``[B, rows * width]`` of block ``block_index`` (drafts with redrawn parts)."""


@dataclass
class LocalSpeculativeOutput:
    """Result of :func:`local_speculative_generate`.

    Attributes:
        sequences: LongTensor ``[B, H * W]`` image tokens in raster order.
        drafted: bool ``[B, H * W]``: True where the drafted token was kept, False where the target drew it.
        stats: :class:`SpecStats`. ``mean_accepted_length``: per (row, target pass), the drafts it kept plus
            one target token (blocks end with the image: nothing past it is counted). Under "reverify" that
            adds up to every token of the image; "parallel" counts one target token per (row, pass) however
            many the pass redrew.
    """

    sequences: torch.Tensor
    drafted: torch.Tensor
    stats: SpecStats


@torch.no_grad()
def local_speculative_generate(target: Target, drafter: RowBlockDrafter, grid: tuple[int, int], *, block_rows: int,
                               radius: int = 1, attention_mask: torch.Tensor | None = None,
                               input_ids: torch.Tensor | None = None,
                               sampling: SamplingConfig = SamplingConfig(do_sample=False),
                               rule: AcceptanceRule | None = None, generator: torch.Generator | None = None,
                               stats: SpecStats | None = None, resample: str = "parallel",
                               callback: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
                               **model_inputs: Any) -> LocalSpeculativeOutput:
    """Generate a ``grid = (H, W)`` token image block by block with local rejection and resampling.

    Args:
        target: the target interface (``CausalLMRunner`` / ``GuidedRunner``); its prefill gets
            ``input_ids``, ``attention_mask`` and ``model_inputs`` (e.g. an image model's condition).
        drafter: a :class:`RowBlockDrafter` proposing ``block_rows`` rows per call.
        block_rows: grid rows per block; must divide H.
        radius: neighbourhood radius l of the local resampling (0: only the rejected tokens).
        resample: "parallel" (all redrawn tokens from this pass's distributions, the paper's),
            "sequential" (in raster order, each given the final tokens before it; slower, see above) or
            "reverify" (raster verification up to the first rejection, then Jacobi passes over the rest).
        sampling: how the target's logits become distributions (greedy when ``do_sample=False``).
        rule: acceptance rule (default: exact when sampling, greedy otherwise); its ``greedy`` flag
            decides whether redrawn tokens are argmax or sampled.
        callback: ``fn(block_index, block_tokens [B, rows*W], block_drafted [B, rows*W])`` per block.
    """
    height, width = _check_grid(grid)
    check_positive_int(block_rows, "block_rows")
    if height % block_rows:
        raise ValueError(f"block_rows={block_rows} must divide the grid height {height}")
    if not isinstance(radius, int) or isinstance(radius, bool) or radius < 0:
        raise ValueError(f"radius must be an integer >= 0, got {radius!r}")
    if resample not in RESAMPLE_MODES:
        raise ValueError(f"resample must be one of {RESAMPLE_MODES}, got {resample!r}")
    rule = rule or default_rule(sampling)
    to_probs = target_probs_fn(sampling, rule)
    stats = stats if stats is not None else SpecStats()
    block_len = block_rows * width

    with stats.phase("prefill"):
        out = target.prefill(input_ids, attention_mask, **model_inputs)
        drafter.prefill(attention_mask, **model_inputs)
    stats.target_calls += 1
    last_logits = out.logits[:, -1]  # [B, V] predicts the next token after what the cache holds
    batch = last_logits.shape[0]
    device = last_logits.device
    rule.check_vocab(last_logits.shape[-1])
    sequences = torch.zeros(batch, height * width, dtype=torch.long, device=device)
    drafted_map = torch.zeros(batch, height * width, dtype=torch.bool, device=device)
    rewrite = torch.zeros(batch, 0, dtype=torch.long, device=device)  # final tokens the cache lacks

    with value_checks(False):
        for block in range(height // block_rows):
            calls_before = drafter.calls
            with stats.phase("draft"):
                draft_tokens, draft_probs = drafter.propose(block)
            _check_draft(draft_tokens, draft_probs, batch, block_len, last_logits.shape[-1])

            with stats.phase("target"):
                target.begin_round()
                step = target.forward(torch.cat([rewrite, draft_tokens], 1))
            stats.target_calls += 1
            logits = torch.cat([last_logits[:, None], step.logits], 1)  # slot t predicts fed token t
            verify_logits = logits[:, rewrite.shape[1]: rewrite.shape[1] + block_len]  # [B, L, V]
            after_block = logits[:, -1]

            with stats.phase("verify"):
                p = to_probs(verify_logits)
                accepted = _check_drafts(rule, p, draft_probs, draft_tokens, generator)  # [B, L]
            if resample == "reverify":
                with stats.phase("target"):
                    raster = _verify_in_raster_order(target, rule, to_probs, p, accepted, draft_tokens, draft_probs,
                                                     rewrite.shape[1], generator)
                final, first, redraw = raster.final, raster.first, ~raster.kept
                if raster.last_logits is not None:  # the logits after the block, seen in final context
                    after_block = raster.last_logits
                extra_calls, row_passes = raster.extra_calls, raster.row_passes
                emitted = batch * block_len  # every token comes from one (row, pass) verification
            else:
                with stats.phase("verify"):
                    sets = local_resample_sets(accepted.view(batch, block_rows, width), radius)
                    redraw = sets.resample.view(batch, block_len)
                    residual = rule.residual(p, draft_probs, draft_tokens)
                    source = torch.where((~accepted).unsqueeze(-1), residual, p)
                extra_calls = 0
                if resample == "sequential" and bool(redraw.any()):
                    with stats.phase("target"):
                        final, first, extra_calls = _redraw_in_raster_order(
                            target, to_probs, source, draft_tokens, redraw, rewrite.shape[1], rule.greedy, generator)
                else:
                    with stats.phase("verify"):
                        redrawn = _draw(source, rule.greedy, generator, "residual", p, draft_probs)
                        final = torch.where(redraw, redrawn, draft_tokens)
                    first = _commit_unchanged_prefix(target, final, draft_tokens, rewrite.shape[1])
                row_passes = batch * (1 + extra_calls)  # each pass yields one target token per row
                emitted = int((~redraw).sum()) + row_passes  # kept drafts + those target tokens

            span = slice(block * block_len, (block + 1) * block_len)
            sequences[:, span] = final
            drafted_map[:, span] = ~redraw
            stats.tokens += batch * block_len
            stats.target_calls += extra_calls
            stats.verify_steps += row_passes
            stats.emitted += emitted
            stats.record_position_checks(accepted)

            rewrite = final[:, first:]  # final tokens the target's cache lacks, re-fed in front of the next draft
            last_logits = after_block  # read by the next pass only when nothing is re-fed (rewrite empty)
            with stats.phase("draft"):
                drafter.commit(block, final)
            stats.draft_calls += drafter.calls - calls_before  # drafting and the commit's re-feed
            if callback is not None:
                callback(block, final, ~redraw)
    return LocalSpeculativeOutput(sequences, drafted_map, stats)


def _check_drafts(rule: AcceptanceRule, p: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor,
                  generator: torch.Generator | None) -> torch.Tensor:
    """The rule's acceptance test of every drafted token ``[B, L]``: ``u * draft_mass < target_mass``."""
    target_mass, draft_mass = rule.masses(p, draft_probs, draft_tokens)
    return draw_uniforms(draft_tokens.shape, p, generator) * draft_mass < target_mass


def _draw(dist: torch.Tensor, greedy: bool, generator: torch.Generator | None, name: str,
          target_probs: torch.Tensor | None = None, draft_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Redrawn tokens from ``dist [..., V]``: argmax for greedy rules, a sample otherwise. A NaN, infinite or
    all-zero row raises naming the target's or the drafter's distribution it came from (``target_probs``,
    ``draft_probs``) when one of them has a bad row, else ``name``."""
    try:
        return draw_tokens(dist, greedy, generator=generator, name=name)
    except NonFiniteProbabilitiesError as error:
        raise blame_inputs(error, ("target distribution", target_probs),
                           ("draft distribution", draft_probs)) from None


def _commit_unchanged_prefix(target: Target, final: torch.Tensor, draft_tokens: torch.Tensor, rewrite_len: int) -> int:
    """After parallel resampling: keep the cache up to the first changed token of the block (the same
    column for every row, so rows stay aligned) and return that column."""
    changed = (final != draft_tokens).any(0)  # [L]
    first = int(changed.nonzero()[0]) if bool(changed.any()) else final.shape[1]
    target.commit(torch.arange(rewrite_len + first, device=final.device).expand(final.shape[0], -1))
    return first


def _redraw_in_raster_order(target: Target, to_probs: Callable[[torch.Tensor], torch.Tensor], source: torch.Tensor,
                            draft_tokens: torch.Tensor, redraw: torch.Tensor, rewrite_len: int, greedy: bool,
                            generator: torch.Generator | None) -> tuple[torch.Tensor, int, int]:
    """Sequential local resampling of one verified block.

    The first column with a redrawn token takes this pass's distributions ``source`` (everything before
    it is final). After it, the target is run over the final tokens up to each next redrawn column and
    that column is drawn from the target's new distribution. Rows that redraw nothing in a column keep
    their draft there. Returns the final block, the first block column the target's cache does not
    hold (to be re-fed in front of the next block) and the number of extra target calls.
    """
    batch = draft_tokens.shape[0]
    columns = redraw.any(0).nonzero().flatten().tolist()
    final = draft_tokens.clone()
    fed_until = columns[0]
    redrawn = _draw(source[:, fed_until], greedy, generator, "residual")
    final[:, fed_until] = torch.where(redraw[:, fed_until], redrawn, final[:, fed_until])
    target.commit(torch.arange(rewrite_len + fed_until, device=final.device).expand(batch, -1))
    for column in columns[1:]:
        target.begin_round()
        step = target.forward(final[:, fed_until:column])
        target.commit(torch.arange(column - fed_until, device=final.device).expand(batch, -1))
        redrawn = _draw(to_probs(step.logits[:, -1]), greedy, generator, "target distribution")
        final[:, column] = torch.where(redraw[:, column], redrawn, final[:, column])
        fed_until = column
    return final, fed_until, len(columns) - 1


@dataclass
class _RasterVerification:
    """What :func:`_verify_in_raster_order` leaves: the final block ``[B, L]``, the kept-draft map, the
    first block column the target's cache lacks, the extra target calls, the (row, pass) verifications
    that decided at least one token, and the last pass's logits after the block (None: no extra pass)."""

    final: torch.Tensor
    kept: torch.Tensor
    first: int
    extra_calls: int
    row_passes: int
    last_logits: torch.Tensor | None


def _verify_in_raster_order(target: Target, rule: AcceptanceRule, to_probs: Callable[[torch.Tensor], torch.Tensor],
                            p: torch.Tensor, accepted: torch.Tensor, draft_tokens: torch.Tensor,
                            draft_probs: torch.Tensor | None, rewrite_len: int, generator: torch.Generator | None
                            ) -> _RasterVerification:
    """Raster-order verification of one block's drafts with re-verification (``resample="reverify"``).

    Per row, the drafts are accepted up to the first rejection, which is redrawn from the rule's residual
    given the final tokens before it (the speculative-decoding step). The positions after it are decided
    by the next target pass, which runs over the final tokens from the earliest redrawn column of the
    batch to the end of the block: every decision is made in the context of final tokens only, and a
    row's decisions stand once made (fresh uniforms only for undecided positions), so with an exact rule
    the output is distributed as target-only decoding. What that pass verifies behind a redrawn token
    are not the block's drafts (they were made for the old token) but the target's own proposals at
    those positions from the pass that found the rejection (Jacobi refinement, as in SJD: a draw from p,
    with p as the draft distribution); accepted proposals count as kept drafts. All of them are
    replaced: keeping the drafts that passed their check in the pass's draft context would select drafts
    by their value, and the selected ones would no longer follow the draft distribution the ratio
    divides by (a chi-square test caught that variant).

    ``p [B, L, V]`` and ``accepted [B, L]`` come from the block's first pass (whose context is final for
    every row up to its first rejection). The rule's residual is computed only where a token is redrawn.
    """
    batch, length = draft_tokens.shape
    device = draft_tokens.device
    rows = torch.arange(batch, device=device)
    columns = torch.arange(length, device=device)
    final, kept = draft_tokens.clone(), torch.zeros_like(draft_tokens, dtype=torch.bool)
    frontier = torch.zeros(batch, dtype=torch.long, device=device)  # per row: positions < frontier are final
    fed_from, lead = 0, rewrite_len  # block column of the pass's first fed draft slot, slots fed before it
    extra_calls, row_passes, last_logits = 0, 0, None
    while True:
        active = frontier < length
        row_passes += int(active.sum())
        # 1. Each active row's accepted run from its frontier and its first rejection (length: none).
        undecided = columns.unsqueeze(0) >= frontier.unsqueeze(1)
        rejected_at = torch.where(undecided & ~accepted, columns, length).min(1).values
        rejected_at = torch.where(active, rejected_at, length)
        kept |= undecided & (columns.unsqueeze(0) < rejected_at.unsqueeze(1))
        redrawn = rejected_at < length
        if bool(redrawn.any()):
            at = rejected_at.clamp(max=length - 1)
            residual = rule.residual(p[rows, at], None if draft_probs is None else draft_probs[rows, at],
                                     draft_tokens[rows, at])
            draw = _draw(residual, rule.greedy, generator, "residual", p, draft_probs)
            final[rows, at] = torch.where(redrawn, draw, final[rows, at])
        frontier = torch.where(active, (rejected_at + 1).clamp(max=length), frontier)
        # Jacobi refinement: every draft after a redrawn token is replaced by the target's own proposal from
        # this pass (all of them: keeping only those that passed a check would bias the proposals).
        stale = columns.unsqueeze(0) > rejected_at.unsqueeze(1)
        if bool(stale.any()):
            proposal = _draw(p, rule.greedy, generator, "target distribution")
            draft_tokens = torch.where(stale, proposal, draft_tokens)
            final = torch.where(stale, proposal, final)
            if draft_probs is not None:
                draft_probs = torch.where(stale.unsqueeze(-1), p, draft_probs)
        # 2. Keep the cache up to the earliest redrawn column (its slots before it hold final tokens).
        first = int(rejected_at.min())
        target.commit(torch.arange(lead + first - fed_from, device=device).expand(batch, -1))
        if bool((frontier >= length).all()):
            return _RasterVerification(final, kept, first, extra_calls, row_passes, last_logits)
        # 3. Re-verify every undecided draft against a pass over the final tokens from that column on.
        target.begin_round()
        step = target.forward(final[:, first:])
        extra_calls += 1
        fed_from, lead, last_logits = first, 0, step.logits[:, -1]
        # logits[:, i] predicts block column first + 1 + i; columns <= first are decided already
        vocab = step.logits.shape[-1]  # decided columns keep uniform placeholder rows (never read)
        p = torch.full((batch, length, vocab), 1.0 / vocab, dtype=step.logits.dtype, device=device)
        p[:, first + 1:] = to_probs(step.logits[:, :-1])
        accepted = _check_drafts(rule, p, draft_probs, draft_tokens, generator)


def _check_grid(grid: tuple[int, int]) -> tuple[int, int]:
    if not (isinstance(grid, (tuple, list)) and len(grid) == 2):
        raise ValueError(f"grid must be (height, width), got {grid!r}")
    height, width = grid
    check_positive_int(height, "grid height")
    check_positive_int(width, "grid width")
    return int(height), int(width)


def _check_draft(tokens: torch.Tensor, probs: torch.Tensor | None, batch: int, length: int, vocab: int) -> None:
    if not isinstance(tokens, torch.Tensor) or tuple(tokens.shape) != (batch, length):
        got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"the block drafter must return tokens [B, rows * width] = {(batch, length)}, got {got}")
    if probs is not None and tuple(probs.shape) != (batch, length, vocab):
        raise ValueError(f"the block drafter's probs must be {(batch, length, vocab)} (target vocab {vocab}), "
                         f"got {tuple(probs.shape)}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"drafted tokens must lie in [0, {vocab}), the target's vocabulary")

