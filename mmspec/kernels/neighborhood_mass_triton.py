"""Triton kernel for the neighbourhood mass of LANTERN / MuLo-SD (imported lazily, like every kernel).

Grid ``(N, cdiv(M, BLOCK_M))``: a program takes BLOCK_M tokens of one probability row and walks their
neighbour lists in blocks of BLOCK_K columns. Per block it gathers ``probs[n, neighbors[t, j]]``
(padding -1 reads nothing), adds the block to the running total and, when a budget is given, forms
the running cumulative mass and keeps the largest cumulative value that is still <= budget. Because
the masses are non-negative the cumulative mass never decreases, so that value is exactly c_J, the
mass of the longest prefix within the budget.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _neighborhood_mass_kernel(
    probs_ptr,  # [N, V]
    tokens_ptr,  # [N, M] int
    neighbors_ptr,  # [V, k] int, -1 = padding
    budget_ptr,  # [N, M] (unused without HAS_BUDGET)
    total_ptr,  # [N, M] out
    prefix_ptr,  # [N, M] out (unused without HAS_BUDGET)
    M,
    V,
    k,
    HAS_BUDGET: tl.constexpr,
    ACC_DTYPE: tl.constexpr,  # tl.float32, or tl.float64 for float64 probs
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    m_offs = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m_offs < M
    k_offs = tl.arange(0, BLOCK_K)
    tok = tl.load(tokens_ptr + row * M + m_offs, mask=m_mask, other=0).to(tl.int64)  # [BLOCK_M]
    probs_row = probs_ptr + row * V
    total = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)
    if HAS_BUDGET:
        budget = tl.load(budget_ptr + row * M + m_offs, mask=m_mask, other=0.0).to(ACC_DTYPE)
        running = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)
        prefix = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)
    for start in range(0, k, BLOCK_K):
        cols = start + k_offs
        tile_mask = m_mask[:, None] & (cols[None, :] < k)
        nb = tl.load(neighbors_ptr + tok[:, None] * k + cols[None, :], mask=tile_mask, other=-1)
        valid = tile_mask & (nb >= 0)
        mass = tl.load(probs_row + nb.to(tl.int64), mask=valid, other=0.0).to(ACC_DTYPE)  # [BLOCK_M, BLOCK_K]
        block_total = tl.sum(mass, axis=1)
        total += block_total
        if HAS_BUDGET:
            cum = running[:, None] + tl.cumsum(mass, axis=1)
            within = tl.where(cum <= budget[:, None], cum, 0.0)
            prefix = tl.maximum(prefix, tl.max(within, axis=1))
            running += block_total
    tl.store(total_ptr + row * M + m_offs, total, mask=m_mask)
    if HAS_BUDGET:
        tl.store(prefix_ptr + row * M + m_offs, prefix, mask=m_mask)


def neighborhood_mass_triton(probs: torch.Tensor, tokens: torch.Tensor, neighbors: torch.Tensor,
                             budget: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the neighbourhood-mass kernel (inputs already checked by the dispatcher)."""
    N, V = probs.shape
    M = tokens.shape[1]
    k = neighbors.shape[1]
    fp64 = probs.dtype == torch.float64
    out_dtype = torch.float64 if fp64 else torch.float32
    total = torch.zeros(N, M, dtype=out_dtype, device=probs.device)
    prefix = torch.zeros(N, M, dtype=out_dtype, device=probs.device) if budget is not None else None
    if N == 0 or M == 0 or k == 0:
        return total, prefix
    block_m = max(2, min(16, triton.next_power_of_2(M)))
    cap = 8192 if triton.knobs.runtime.interpret else 2048  # tile elements per block
    block_k = max(2, min(triton.next_power_of_2(k), cap // block_m))
    budget_arg = budget.to(out_dtype).contiguous() if budget is not None else total
    grid = (N, triton.cdiv(M, block_m))
    _neighborhood_mass_kernel[grid](
        probs.contiguous(), tokens.contiguous(), neighbors.contiguous(), budget_arg, total,
        prefix if prefix is not None else total, M, V, k,
        HAS_BUDGET=budget is not None, ACC_DTYPE=tl.float64 if fp64 else tl.float32,
        BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4,
        enable_fp_fusion=False,  # no fused multiply-adds: same roundings as the torch reference
    )
    return total, prefix
