"""Triton kernel for fused chain verification (imported lazily: importing mmspec never needs triton).

One program per batch row does the whole verification of a chain of K drafts:

1. the K acceptance tests as one vector op (``u_i * q(x_i) < p(x_i)``, or argmax matching when greedy),
   giving n = the first rejection (or K);
2. pass 1 over V in blocks: the mass of the residual ``w = max(0, p_n - q_n)`` (and of p_n, the
   fallback when the residual vanishes or when n == K);
3. pass 2 over V in blocks: inverse-CDF search for the smallest j with ``cumsum(w)[j] > u * sum(w)``
   with a running prefix carried from block to block.

Greedy rows need no residual: a single pass over all K+1 target rows computes their argmaxes.

Numerics match :func:`mmspec.kernels.reference.chain_verify_torch`: element-wise work in float32 (float64
for float64 inputs); the CDF is accumulated in float64 and rounded to the compute dtype before the
comparison, which is what torch's CPU ``cumsum`` does for float32, so on CPU (interpreter) the kernel
picks the same token bit for bit. The kernel is memory bound, so the float64 accumulation is free.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmspec.kernels.reference import RESIDUAL_EPS

_RESIDUAL_EPS = tl.constexpr(RESIDUAL_EPS)  # globals read inside @triton.jit must be constexpr


@triton.jit
def _to_compute(x, FP64: tl.constexpr):
    if FP64:
        return x.to(tl.float64)
    else:
        return x.to(tl.float32)


@triton.jit
def _first_rejection(draft_tokens_ptr, draft_probs_ptr, target_row0, accept_u_ptr, b, K, V,
                     HAS_DRAFT_PROBS: tl.constexpr, FP64: tl.constexpr, BLOCK_K: tl.constexpr):
    """(n, x_n): the first rejected position of row b (K if none) and its draft token."""
    k_offs = tl.arange(0, BLOCK_K)
    k_mask = k_offs < K
    x = tl.load(draft_tokens_ptr + b * K + k_offs, mask=k_mask, other=0).to(tl.int64)
    p = _to_compute(tl.load(target_row0 + k_offs.to(tl.int64) * V + x, mask=k_mask, other=0.0), FP64)
    if HAS_DRAFT_PROBS:
        q = _to_compute(tl.load(draft_probs_ptr + (b * K + k_offs) * V + x, mask=k_mask, other=1.0), FP64)
    else:
        q = _to_compute(tl.full([BLOCK_K], 1.0, tl.float32), FP64)
    u = _to_compute(tl.load(accept_u_ptr + b * K + k_offs, mask=k_mask, other=0.0), FP64)
    rejected = k_mask & ((u * q < p) == 0)
    n = tl.min(tl.where(rejected, k_offs, K), axis=0)
    x_n = tl.sum(tl.where(k_offs == n, x, 0), axis=0)
    return n, x_n


@triton.jit
def _draft_column(q_row, cols, x_n, limit, V, HAS_DRAFT_PROBS: tl.constexpr, FP64: tl.constexpr):
    """q_n at ``cols``, zero at columns >= ``limit`` (0 when there is no rejection: q is not used)."""
    if HAS_DRAFT_PROBS:
        qv = _to_compute(tl.load(q_row + cols, mask=(cols < V) & (cols < limit), other=0.0), FP64)
    else:
        qv = _to_compute(tl.where((cols == x_n) & (cols < limit), 1.0, 0.0), FP64)
    return qv


@triton.jit
def _cdf_search(p_row, q_row, x_n, r_limit, use_residual, threshold, running, lo, length, V,
                HAS_DRAFT_PROBS: tl.constexpr, FP64: tl.constexpr, BLOCK_V: tl.constexpr):
    """Smallest column j in ``[lo, lo + length)`` with ``running + cumsum(w)[j] > threshold`` (V if none),
    w the residual ``max(0, p_n - q_n)`` where ``use_residual``, else ``p_n``; ``running`` is the float64
    mass before ``lo``."""
    v_offs = tl.arange(0, BLOCK_V)
    found = V
    for start in range(0, length, BLOCK_V):
        cols = lo + start + v_offs
        in_v = cols < V
        pv = _to_compute(tl.load(p_row + cols, mask=in_v, other=0.0), FP64)
        qv = _draft_column(q_row, cols, x_n, r_limit, V, HAS_DRAFT_PROBS, FP64)
        w = tl.where(use_residual, tl.maximum(pv - qv, 0.0), pv).to(tl.float64)
        cdf = _to_compute(running + tl.cumsum(w, axis=0), FP64)
        hit = in_v & (cdf > threshold)
        found = tl.minimum(found, tl.min(tl.where(hit, cols, V), axis=0))
        running += tl.sum(w, axis=0)
    return found


@triton.jit
def _chain_verify_kernel(
    draft_tokens_ptr,  # [B, K] int
    draft_probs_ptr,  # [B, K, V] (unused when HAS_DRAFT_PROBS is False)
    target_probs_ptr,  # [B, K+1, V]
    accept_u_ptr,  # [B, K]
    sample_u_ptr,  # [B]
    num_accepted_ptr,  # [B] int64 out
    next_tokens_ptr,  # [B] int64 out
    K,
    V,
    HAS_DRAFT_PROBS: tl.constexpr,
    GREEDY: tl.constexpr,
    FP64: tl.constexpr,
    BLOCK_K: tl.constexpr,  # power of two >= K + 1
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    k_offs = tl.arange(0, BLOCK_K)
    k_mask = k_offs < K
    v_offs = tl.arange(0, BLOCK_V)
    target_row0 = target_probs_ptr + b * (K + 1) * V  # row i of this batch entry at + i * V

    if GREEDY:
        x = tl.load(draft_tokens_ptr + b * K + k_offs, mask=k_mask, other=0).to(tl.int64)  # [BLOCK_K]
        # One pass over the K+1 target rows: running (max, first argmax) per row.
        rows_mask = k_offs < K + 1
        best = tl.full([BLOCK_K], float("-inf"), tl.float32)
        if FP64:
            best = best.to(tl.float64)
        best_idx = tl.zeros([BLOCK_K], dtype=tl.int64)
        for start in range(0, V, BLOCK_V):
            cols = start + v_offs
            ptrs = target_row0 + k_offs[:, None].to(tl.int64) * V + cols[None, :]
            tile = tl.load(ptrs, mask=rows_mask[:, None] & (cols[None, :] < V), other=float("-inf"))
            tile = _to_compute(tile, FP64)
            blk_max, blk_idx = tl.max(tile, axis=1, return_indices=True, return_indices_tie_break_left=True)
            better = blk_max > best  # strict: an earlier block keeps ties (first maximal index)
            best_idx = tl.where(better, blk_idx.to(tl.int64) + start, best_idx)
            best = tl.where(better, blk_max, best)
        rejected = k_mask & (x != best_idx)
        n = tl.min(tl.where(rejected, k_offs, K), axis=0)
        next_token = tl.sum(tl.where(k_offs == n, best_idx, 0), axis=0)
    else:
        # 1. Acceptance tests of all K drafts at once (accept iff u * q(x) < p(x)): n = first rejection.
        n, x_n = _first_rejection(draft_tokens_ptr, draft_probs_ptr, target_row0, accept_u_ptr, b, K, V,
                                  HAS_DRAFT_PROBS, FP64, BLOCK_K)
        is_rejected = n < K
        # Scalar conditions become column limits (V or 0) so every load mask is a plain vector compare.
        q_limit = tl.where(is_rejected, V, 0)

        p_row = target_row0 + n.to(tl.int64) * V  # p_n (p_K when all were accepted)
        q_row = draft_probs_ptr + (b * K + n) * V  # only read when is_rejected

        # 2. Pass 1: mass of the residual max(0, p_n - q_n) and of p_n itself (float64 accumulators).
        res_mass = tl.zeros([BLOCK_V], dtype=tl.float64)
        p_mass = tl.zeros([BLOCK_V], dtype=tl.float64)
        for start in range(0, V, BLOCK_V):
            cols = start + v_offs
            in_v = cols < V
            pv = _to_compute(tl.load(p_row + cols, mask=in_v, other=0.0), FP64)
            qv = _draft_column(q_row, cols, x_n, q_limit, V, HAS_DRAFT_PROBS, FP64)
            res_mass += tl.maximum(pv - qv, 0.0).to(tl.float64)
            p_mass += pv.to(tl.float64)
        res_total = tl.sum(res_mass, axis=0)
        p_total = tl.sum(p_mass, axis=0)
        use_residual = is_rejected & (res_total > _RESIDUAL_EPS)
        total = tl.where(use_residual, res_total, p_total)
        r_limit = tl.where(use_residual, V, 0)

        # 3. Pass 2: smallest j with cumsum(w)[j] > u * sum(w), a running float64 prefix across blocks.
        u_s = _to_compute(tl.load(sample_u_ptr + b), FP64)
        threshold = u_s * _to_compute(total, FP64)
        found = _cdf_search(p_row, q_row, x_n, r_limit, use_residual, threshold, tl.zeros([], dtype=tl.float64),
                            0, V, V, HAS_DRAFT_PROBS, FP64, BLOCK_V)
        next_token = tl.minimum(found, V - 1).to(tl.int64)

    tl.store(num_accepted_ptr + b, n.to(tl.int64))
    tl.store(next_tokens_ptr + b, next_token.to(tl.int64))


def _block_v(V: int) -> int:
    # Interpreted runs vectorise per block in numpy, so larger blocks are much faster there.
    cap = 4096 if triton.knobs.runtime.interpret else 1024
    return min(cap, triton.next_power_of_2(V))


def output_buffers(batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num_accepted [B], next_tokens [B])`` int64 buffers the chain-verification kernels write."""
    return (torch.empty(batch, dtype=torch.int64, device=device),
            torch.empty(batch, dtype=torch.int64, device=device))


def launch_inputs(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                  accept_uniforms: torch.Tensor, sample_uniforms: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Contiguous kernel arguments: tokens, draft probabilities (the target's as a placeholder without
    them), target probabilities and the uniforms in the compute dtype (tiny: converted here, with the
    reference's rounding)."""
    target_probs = target_probs.contiguous()
    cdtype = torch.float64 if target_probs.dtype == torch.float64 else torch.float32
    return (draft_tokens.contiguous(), draft_probs.contiguous() if draft_probs is not None else target_probs,
            target_probs, accept_uniforms.to(cdtype).contiguous(), sample_uniforms.to(cdtype).contiguous())


def chain_verify_triton(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                        target_probs: torch.Tensor, accept_uniforms: torch.Tensor,
                        sample_uniforms: torch.Tensor, greedy: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the fused chain-verification kernel (inputs already checked by the dispatcher)."""
    B, K = draft_tokens.shape
    V = target_probs.shape[-1]
    num_accepted, next_tokens = output_buffers(B, target_probs.device)
    if B == 0:
        return num_accepted, next_tokens
    dtype = target_probs.dtype
    draft_tokens, draft_probs_arg, target_probs, accept_uniforms, sample_uniforms = launch_inputs(
        draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms)
    block_k = max(2, triton.next_power_of_2(K + 1))
    block_v = _block_v(V)
    if greedy:  # the greedy pass holds a [BLOCK_K, BLOCK_V] tile
        block_v = max(16, min(block_v, 8192 // block_k))
    _chain_verify_kernel[(B,)](
        draft_tokens, draft_probs_arg, target_probs, accept_uniforms, sample_uniforms,
        num_accepted, next_tokens, K, V,
        HAS_DRAFT_PROBS=draft_probs is not None, GREEDY=bool(greedy), FP64=dtype == torch.float64,
        BLOCK_K=block_k, BLOCK_V=block_v, num_warps=4,
        enable_fp_fusion=False,  # no fused multiply-adds: same roundings as the torch reference
    )
    return num_accepted, next_tokens
