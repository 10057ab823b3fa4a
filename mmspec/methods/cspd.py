"""CSpD (continuous speculative decoding, Wang et al. 2024, arXiv 2411.11925) on MAR-style continuous-token
models: a smaller draft MAR runs ``draft_length`` MAR iterations, one target forward scores every drafted
token, the target head runs each token's chain with the same noise, and the core verifies them with the
trajectory-aligned surrogate ratio (:func:`mmspec.continuous.cspd_verify`).

The pipeline (:class:`~mmspec.pipelines.continuous_ar_image.ContinuousARImagePipeline`) provides
``draft_transformer``; its loop state (:class:`~mmspec.pipelines.continuous_ar_image.MARState`) provides the
MAR schedule, the call's random numbers, the tokens generated so far, binding a model to the call's
conditions and the target-only iterations that pre-fill. How the draft and target passes map onto MAR's
iterations is in docs/pipeline_continuous.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch

from mmspec.continuous import EXHAUSTED_RESIDUALS, LOGDET_TERMS, RESIDUAL_LOOPS, cspd_verify
from mmspec.methods.base import (
    BuildRequest,
    MethodConfig,
    MethodPlan,
    check_bool_field,
    check_choice_field,
    check_float_field,
    check_int_field,
    register,
)
from mmspec.stats import SpecStats
from mmspec.validation import MIN_TEMPERATURE

VERIFY_ORDERS = ("independent", "chain", "iteration")
VERIFY_CONTEXTS = ("round", "exact")
#: Largest ``density_temperature`` accepted: the official code's "inner temperature" is about 42-50, and the
#: acceptance densities' variances grow with its square (1e6 at most: finite in float32 and bfloat16).
DENSITY_TEMPERATURE_MAX = 1e3


@register("cspd")
@dataclass(frozen=True)
class CSpDConfig(MethodConfig):
    """CSpD's settings (lossy in general: see ``verify_context``; exact with ``verify_context="exact"`` and a
    draft identical to the target).

    The defaults keep the target's quality on the zoo (docs/pipeline_continuous.md, "Speed and quality"):
    three draft iterations per target pass after a quarter of the tokens is pre-filled. The official code's
    gamma 8 with 5 % pre-filled is faster and costs quality there.

    Attributes:
        draft_length: gamma, draft MAR iterations per target pass.
        prefill_ratio: fraction of the tokens the target generates before drafting starts (whole iterations,
            until at least ``ceil(prefill_ratio * L)`` tokens exist), in [0, 1).
        verify_order: "independent" (the official code: every drafted token verified on its own and committed,
            residual samples for the rejected), "chain" (the paper: stop at the first rejected token) or
            "iteration" (stop after the first MAR iteration holding a rejection, keeping all of its tokens).
        verify_context: "round" (the official code: the target conditions every drafted token on the tokens
            before the round; an approximation when gamma > 1) or "exact" (each on its own iteration's
            context, one batched target call of gamma times the rows).
        density_temperature: multiplies the last-step standard deviations in the acceptance densities (1:
            CSpD's surrogate as specified; the official code's "inner temperature" is about 42 and accepts
            drafts the target would not make).
        max_tries: bound on residual proposals per rejected token (then ``exhausted_residual``, counted in
            ``stats.residual_fallbacks``).
        logdet_term: how the earlier denoising steps enter the ratio: "gaussian_normalisers" (the paper's
            trajectory densities: sigma_q / sigma_p per step) or "sigma_ratio_product" (the released code:
            sigma_p / sigma_q, the opposite sign).
        temper_residual: whether ``density_temperature`` applies to the residual test as well (True) or only
            to the acceptance test (False: the released code).
        residual_loop: "first_accepted" (each rejected token keeps its first accepted residual proposal) or
            "whole_batch_last_accepted" (the released code: every verified token, accepted ones included,
            runs the residual test until each has passed once; a rejected token keeps its last passed
            proposal). Both draw from the same residual distribution; the released loop runs longer.
        exhausted_residual: what a rejected token gets after ``max_tries`` refused proposals:
            "last_target_draw" (a sample of the target's last-step Gaussian, close to what the target would
            produce) or "zero" (the released code: a zero latent, which no model produces).

    The released code's verification: ``logdet_term="sigma_ratio_product", density_temperature=42,
    temper_residual=False, residual_loop="whole_batch_last_accepted", exhausted_residual="zero",
    max_tries=100`` (docs/official_code.md).
    """

    pipelines: ClassVar[tuple[str, ...]] = ("continuous",)

    draft_length: int = 3
    prefill_ratio: float = 0.25
    verify_order: str = "independent"
    verify_context: str = "round"
    density_temperature: float = 1.0
    max_tries: int = 64
    logdet_term: str = "gaussian_normalisers"
    temper_residual: bool = True
    residual_loop: str = "first_accepted"
    exhausted_residual: str = "last_target_draw"

    def validate(self) -> None:
        check_int_field(self, "draft_length", 1, 1024)
        check_float_field(self, "prefill_ratio", 0.0, 1.0, high_open=True)
        check_choice_field(self, "verify_order", VERIFY_ORDERS)
        check_choice_field(self, "verify_context", VERIFY_CONTEXTS)
        check_float_field(self, "density_temperature", MIN_TEMPERATURE, DENSITY_TEMPERATURE_MAX)
        check_int_field(self, "max_tries", 1, 100_000)
        check_choice_field(self, "logdet_term", LOGDET_TERMS)
        check_bool_field(self, "temper_residual")
        check_choice_field(self, "residual_loop", RESIDUAL_LOOPS)
        check_choice_field(self, "exhausted_residual", EXHAUSTED_RESIDUALS)

    def build(self, pipeline: Any, request: BuildRequest) -> MethodPlan:
        if getattr(pipeline, "draft_transformer", None) is None:
            raise ValueError("method 'cspd' needs a draft_transformer; this pipeline has none")
        return MethodPlan(drafter=pipeline.draft_transformer,
                          loop=partial(cspd_loop, config=self, generator=request.generator))


def cspd_loop(target: Any, drafter: Any, state: Any, *, config: CSpDConfig,
              generator: torch.Generator | None = None) -> None:
    """CSpD behind the continuous pipeline's loop signature ``(target, drafter, state)``: the target
    (bound to the call's conditions) pre-fills, then rounds of ``config.draft_length`` draft iterations with
    ``drafter`` (the draft MAR) run until every row of ``state`` is complete."""
    draft = state.bind(drafter)
    seq_len = state.seq_len
    prefill = min(seq_len, math.ceil(config.prefill_ratio * seq_len))
    with state.stats.phase("prefill"):
        state.target_iterations(target, until=prefill)
    state.stats.prefill_tokens = int(state.done.sum())
    cspd_rounds(state, target, draft, config, generator)


def cspd_rounds(state: Any, target: Any, draft: Any, config: CSpDConfig, generator: torch.Generator | None) -> None:
    """CSpD rounds until every row is complete: gamma draft iterations, one target call, core verification."""
    schedule, stats, gamma = state.schedule, state.stats, config.draft_length
    seq_len = state.seq_len
    while int(state.done.min()) < seq_len:
        rows_active = (state.done < seq_len).nonzero().squeeze(1)                   # [R]
        begin = state.done[rows_active].clone()                                     # [R] first uncommitted
        # 1. Draft: gamma MAR iterations per row; iteration k covers the rest of the set holding its start.
        cursor = begin.clone()
        tokens_rows, tokens_pos, iter_k = [], [], []
        x0s, d_means, d_vars, contexts = [], [], [], []
        with stats.phase("draft"):
            for k in range(gamma):
                live = cursor < seq_len
                if not bool(live.any()):
                    break
                rows = rows_active[live]
                r_tok, p_tok, ctx, end = schedule.rest_of_sets(cursor[live])       # tokens, context, set end
                z, z_u = draft.token_conditions(rows, ctx, state.values, state.orders, r_tok,
                                                state.orders[rows[r_tok], p_tok])
                stats.draft_calls += 1
                noise, guidance = state.token_inputs(rows[r_tok], p_tok)
                x0, means, variances = draft.sample(z, z_u, noise, guidance, state.temperature, state.steps,
                                                    record=True)
                state.values[rows[r_tok], p_tok] = x0                               # visible to later iterations
                tokens_rows.append(rows[r_tok])
                tokens_pos.append(p_tok)
                iter_k.append(torch.full_like(p_tok, k))
                contexts.append(ctx[r_tok])
                x0s.append(x0)
                d_means.append(means)
                d_vars.append(variances)
                cursor[live] = end
        rows_tok, pos_tok = torch.cat(tokens_rows), torch.cat(tokens_pos)           # [N] drafted tokens
        iter_tok, ctx_tok = torch.cat(iter_k), torch.cat(contexts)                  # draft iteration, context
        slot_row = torch.searchsorted(rows_active, rows_tok)                        # active row of each token
        local = pos_tok - begin[slot_row]                                           # position within the round
        draft_x0 = torch.cat(x0s)
        draft_means, draft_vars = torch.cat(d_means, dim=1), torch.cat(d_vars, dim=1)   # [T, N, C]

        # 2. Target: one forward call scores every drafted token, its head runs their aligned chains.
        with stats.phase("target"):
            grid = state.orders[rows_tok, pos_tok]
            if config.verify_context == "round":
                row_ctx = schedule.context_of(begin)                                 # context of each round's start
                z, z_u = target.token_conditions(rows_active, row_ctx, state.values, state.orders, slot_row, grid)
            else:  # one target row per (row, draft iteration), each with that iteration's context
                pair = torch.stack([rows_tok, iter_tok], 1)
                pairs, slot = torch.unique(pair, dim=0, return_inverse=True)
                pair_ctx = torch.zeros(pairs.shape[0], dtype=torch.long, device=pair.device).scatter_(0, slot, ctx_tok)
                z, z_u = target.token_conditions(pairs[:, 0], pair_ctx, state.values, state.orders, slot, grid)
            noise, guidance = state.token_inputs(rows_tok, pos_tok)
            _, target_means, target_vars = target.sample(z, z_u, noise, guidance, state.temperature, state.steps,
                                                         record=True)

        # 3. Verify in the core: surrogate ratio, acceptance in log space, residual by acceptance-rejection.
        with stats.phase("verify"):
            result = cspd_verify(draft_x0, draft_means, draft_vars, target_means, target_vars, generator,
                                 config.density_temperature, config.max_tries, logdet_term=config.logdet_term,
                                 temper_residual=config.temper_residual, residual_loop=config.residual_loop,
                                 exhausted_residual=config.exhausted_residual)
            accepted = result.accepted
            keep = _committed(config.verify_order, accepted, slot_row, local, iter_tok, rows_active.shape[0], gamma)
            verified = keep                                                          # chain: later ones unverified
            commit_rows, commit_pos = rows_tok[keep], pos_tok[keep]
            state.values[commit_rows, commit_pos] = result.samples[keep].to(state.values.dtype)
            state.drafted[commit_rows, commit_pos] = accepted[keep]
            before = state.done.clone()
            new_done = begin.clone()
            new_done.scatter_reduce_(0, slot_row[keep], commit_pos + 1, reduce="amax")
            state.done[rows_active] = new_done
            state.after_target_pass(before)
            stats.drafted_tokens += int(verified.sum())
            stats.accepted_tokens += int((accepted & verified).sum())
            stats.residual_fallbacks += int(result.num_fallbacks)
            _record_positions(stats, rows_tok[verified], local[verified], accepted[verified])


def _committed(verify_order: str, accepted: torch.Tensor, slot_row: torch.Tensor, local: torch.Tensor,
               iter_tok: torch.Tensor, num_rows: int, gamma: int) -> torch.Tensor:
    """Which drafted tokens a round commits (bool ``[N]``), by ``verify_order``: all ("independent"), each
    row's leading accepted run plus its first rejected token ("chain", along the generation order), or each
    row's drafted iterations up to and including the first one holding a rejection ("iteration")."""
    if verify_order == "chain":
        # per row, the drafted tokens in generation order: keep up to the first rejection
        width = int(local.max()) + 1
        dense = torch.ones(num_rows, width, dtype=torch.bool, device=accepted.device)
        dense[slot_row, local] = accepted
        lead = dense.long().cumprod(1).sum(1)                                        # accepted run per row
        return local <= lead[slot_row]                                               # run + first rejected
    if verify_order == "iteration":
        # per row, keep the drafted iterations up to the first one with a rejection, all of its tokens
        first_rejected = torch.full((num_rows,), gamma, dtype=torch.long, device=accepted.device)
        first_rejected.scatter_reduce_(0, slot_row[~accepted], iter_tok[~accepted], reduce="amin")
        return iter_tok <= first_rejected[slot_row]
    return torch.ones_like(accepted)


def _record_positions(stats: SpecStats, rows: torch.Tensor, local: torch.Tensor, accepted: torch.Tensor) -> None:
    """Per draft position (index within the round): verified and accepted counts."""
    if local.numel() == 0:
        return
    length = int(local.max()) + 1
    stats.grow_positions(length)
    attempts = torch.bincount(local, minlength=length).tolist()
    accepts = torch.bincount(local[accepted], minlength=length).tolist()
    for i in range(length):
        stats.position_attempts[i] += attempts[i]
        stats.position_accepts[i] += accepts[i]
