"""Block-wise speculative decoding with local 2-D rejection (MuLo-SD, arXiv 2601.05149).

Raster speculative decoding truncates at the first rejected token. MuLo-SD instead drafts whole
blocks of image rows, lets the target score every drafted token in one pass, and redraws only the
radius-l square neighbourhoods around rejected tokens; the rest of the block stands. This module is
the model-agnostic loop: any :class:`BlockDrafter` (MuLo-SD's low-resolution drafter + up-sampler,
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
from mmspec.sampling import SamplingConfig, draw_uniforms, sample
from mmspec.speculate import Target, default_rule, target_probs_fn
from mmspec.stats import SpecStats
from mmspec.validation import check_positive_int, value_checks


class BlockDrafter(ABC):
    """Proposes whole blocks of grid rows (the drafter side of :func:`local_speculative_generate`)."""

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
        stats: :class:`SpecStats` (``mean_accepted_length``: tokens per row and target verification).
    """

    sequences: torch.Tensor
    drafted: torch.Tensor
    stats: SpecStats


@torch.no_grad()
def local_speculative_generate(target: Target, drafter: BlockDrafter, grid: tuple[int, int], *, block_rows: int,
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
        drafter: a :class:`BlockDrafter` proposing ``block_rows`` rows per call.
        block_rows: grid rows per block; must divide H.
        radius: neighbourhood radius l of the local resampling (0: only the rejected tokens).
        resample: "parallel" (all redrawn tokens from this pass's distributions, the paper's) or
            "sequential" (in raster order, each given the final tokens before it; slower, see above).
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
    if resample not in ("parallel", "sequential"):
        raise ValueError(f"resample must be 'parallel' or 'sequential', got {resample!r}")
    rule = rule or default_rule(sampling)
    to_probs = target_probs_fn(sampling)
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

            with stats.phase("verify"):
                p = to_probs(verify_logits)
                target_mass, draft_mass = rule.masses(p, draft_probs, draft_tokens)
                u = draw_uniforms(draft_tokens.shape, p, generator)
                accepted = u * draft_mass < target_mass  # [B, L]
                sets = local_resample_sets(accepted.view(batch, block_rows, width), radius)
                redraw = sets.resample.view(batch, block_len)
                residual = rule.residual(p, draft_probs, draft_tokens)
                source = torch.where((~accepted).unsqueeze(-1), residual, p)
            if resample == "sequential" and bool(redraw.any()):
                with stats.phase("target"):
                    final, first, extra_calls = _redraw_in_raster_order(
                        target, to_probs, source, draft_tokens, redraw, rewrite.shape[1], rule.greedy, generator)
                stats.target_calls += extra_calls
                stats.verify_steps += batch * extra_calls  # each extra call yields one target token per row
                stats.emitted += batch * extra_calls
            else:
                with stats.phase("verify"):
                    final = torch.where(redraw, _draw(source, rule.greedy, generator), draft_tokens)
                first = _commit_unchanged_prefix(target, final, draft_tokens, rewrite.shape[1])

            span = slice(block * block_len, (block + 1) * block_len)
            sequences[:, span] = final
            drafted_map[:, span] = ~redraw
            stats.tokens += batch * block_len
            stats.verify_steps += batch
            stats.emitted += int((~redraw).sum()) + batch  # kept drafts + one target token per row and pass
            stats.record_position_checks(accepted)

            rewrite = final[:, first:]  # final tokens the target's cache lacks, re-fed in front of the next draft
            last_logits = logits[:, -1]  # read by the next pass only when nothing is re-fed (rewrite empty)
            with stats.phase("draft"):
                drafter.commit(block, final)
            stats.draft_calls += drafter.calls - calls_before  # drafting and the commit's re-feed
            if callback is not None:
                callback(block, final, ~redraw)
    return LocalSpeculativeOutput(sequences, drafted_map, stats)


def _draw(dist: torch.Tensor, greedy: bool, generator: torch.Generator | None) -> torch.Tensor:
    """Redrawn tokens from ``dist [..., V]``: argmax for greedy rules, a sample otherwise."""
    return dist.argmax(-1) if greedy else sample(dist, generator)


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
    final[:, fed_until] = torch.where(redraw[:, fed_until], _draw(source[:, fed_until], greedy, generator),
                                      final[:, fed_until])
    target.commit(torch.arange(rewrite_len + fed_until, device=final.device).expand(batch, -1))
    for column in columns[1:]:
        target.begin_round()
        step = target.forward(final[:, fed_until:column])
        target.commit(torch.arange(column - fed_until, device=final.device).expand(batch, -1))
        final[:, column] = torch.where(redraw[:, column], _draw(to_probs(step.logits[:, -1]), greedy, generator),
                                       final[:, column])
        fed_until = column
    return final, fed_until, len(columns) - 1


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

