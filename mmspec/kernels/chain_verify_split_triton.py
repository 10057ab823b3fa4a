"""Split-V chain verification: several programs per batch row (imported lazily, like the fused kernel).

The fused kernel (:mod:`mmspec.kernels.chain_verify_triton`) runs one program per batch row, so at
B = 1 a single multiprocessor walks the vocabulary twice and verification costs the latency of that
walk (docs/kernels.md, "On a GPU"). Here each row's V is cut into S chunks of ``CHUNK`` columns (a
multiple of ``BLOCK_V``), one program each, in two launches:

* **sampled rows.** Launch 1 (grid B x S): every program repeats the K acceptance tests (one vector op)
  to get the first rejection n, and sums the residual ``max(0, p_n - q_n)`` and ``p_n`` over its chunk:
  partial masses ``[B, S]`` in float64. Launch 2 (grid B x S): every program reads its row's S partial
  masses, forms the same totals, the same choice of residual or ``p_n`` and the same threshold
  ``u * total``, and finds the chunk where the inclusive cumulative sum over chunks first exceeds the
  threshold (identical arithmetic in every program, so exactly one program claims it). That program
  alone searches its chunk for the smallest j with ``cdf[j] > threshold``, starting from the mass of the
  chunks before it. If no chunk's sum exceeds the threshold (rounding at the very top), the last chunk's
  program writes V - 1, as the reference clamps.
* **greedy rows.** Launch 1: the maximum and first argmax of each of the K + 1 target rows within each
  chunk. Launch 2 (grid B): the first maximum over the chunks (chunks are in column order, so ties keep
  the lowest index), the first mismatch n and the next token.

Numerics follow the fused kernel (compute dtype for the element-wise work and the comparisons, float64
masses). The chunk sums are added in another order than one running sum, so a drawn token can differ
from the reference only if ``u * total`` falls within float64 rounding of a step of the CDF; should the
claiming chunk then find no crossing inside itself, it takes its last column.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmspec.kernels.chain_verify_triton import (
    _RESIDUAL_EPS,
    _block_v,
    _cdf_search,
    _draft_column,
    _first_rejection,
    _to_compute,
    launch_inputs,
    output_buffers,
)


@triton.jit
def _split_mass_kernel(
    draft_tokens_ptr, draft_probs_ptr, target_probs_ptr, accept_u_ptr,
    num_accepted_ptr,  # [B] int64 out (written by chunk 0)
    res_part_ptr, p_part_ptr,  # [B, S] float64 out
    K, V, CHUNK, S,
    HAS_DRAFT_PROBS: tl.constexpr, FP64: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    target_row0 = target_probs_ptr + b * (K + 1) * V
    n, x_n = _first_rejection(draft_tokens_ptr, draft_probs_ptr, target_row0, accept_u_ptr, b, K, V,
                              HAS_DRAFT_PROBS, FP64, BLOCK_K)
    q_limit = tl.where(n < K, V, 0)
    p_row = target_row0 + n.to(tl.int64) * V
    q_row = draft_probs_ptr + (b * K + n) * V
    v_offs = tl.arange(0, BLOCK_V)
    res_mass = tl.zeros([BLOCK_V], dtype=tl.float64)
    p_mass = tl.zeros([BLOCK_V], dtype=tl.float64)
    lo = s * CHUNK
    for start in range(0, CHUNK, BLOCK_V):
        cols = lo + start + v_offs
        pv = _to_compute(tl.load(p_row + cols, mask=cols < V, other=0.0), FP64)
        qv = _draft_column(q_row, cols, x_n, q_limit, V, HAS_DRAFT_PROBS, FP64)
        res_mass += tl.maximum(pv - qv, 0.0).to(tl.float64)
        p_mass += pv.to(tl.float64)
    tl.store(res_part_ptr + b * S + s, tl.sum(res_mass, axis=0))
    tl.store(p_part_ptr + b * S + s, tl.sum(p_mass, axis=0))
    if s == 0:
        tl.store(num_accepted_ptr + b, n.to(tl.int64))


@triton.jit
def _split_sample_kernel(
    draft_tokens_ptr, draft_probs_ptr, target_probs_ptr, accept_u_ptr, sample_u_ptr,
    res_part_ptr, p_part_ptr,  # [B, S] float64 in
    next_tokens_ptr,  # [B] int64 out
    K, V, CHUNK, S,
    HAS_DRAFT_PROBS: tl.constexpr, FP64: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    target_row0 = target_probs_ptr + b * (K + 1) * V
    n, x_n = _first_rejection(draft_tokens_ptr, draft_probs_ptr, target_row0, accept_u_ptr, b, K, V,
                              HAS_DRAFT_PROBS, FP64, BLOCK_K)
    is_rejected = n < K
    s_offs = tl.arange(0, BLOCK_S)
    s_mask = s_offs < S
    res = tl.load(res_part_ptr + b * S + s_offs, mask=s_mask, other=0.0)
    pm = tl.load(p_part_ptr + b * S + s_offs, mask=s_mask, other=0.0)
    res_total = tl.sum(res, axis=0)
    use_residual = is_rejected & (res_total > _RESIDUAL_EPS)
    mass = tl.where(use_residual, res, pm)  # float64 per chunk
    total = tl.where(use_residual, res_total, tl.sum(pm, axis=0))
    threshold = _to_compute(tl.load(sample_u_ptr + b), FP64) * _to_compute(total, FP64)
    crossing = s_mask & (_to_compute(tl.cumsum(mass, axis=0), FP64) > threshold)
    owner = tl.min(tl.where(crossing, s_offs, S), axis=0)  # S: no chunk crosses
    if owner == s:
        r_limit = tl.where(use_residual, V, 0)
        p_row = target_row0 + n.to(tl.int64) * V
        q_row = draft_probs_ptr + (b * K + n) * V
        running = tl.sum(tl.where(s_offs < s, mass, 0.0), axis=0)  # mass of the chunks before this one
        lo = s * CHUNK
        found = _cdf_search(p_row, q_row, x_n, r_limit, use_residual, threshold, running, lo, CHUNK, V,
                            HAS_DRAFT_PROBS, FP64, BLOCK_V)
        tl.store(next_tokens_ptr + b, tl.minimum(found, tl.minimum(lo + CHUNK, V) - 1).to(tl.int64))
    if (owner == S) & (s == S - 1):
        tl.store(next_tokens_ptr + b, (V - 1).to(tl.int64))


@triton.jit
def _split_argmax_kernel(
    target_probs_ptr,
    max_part_ptr, idx_part_ptr,  # [B, S, K+1] out: chunk maxima and their first columns
    K, V, CHUNK, S,
    FP64: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    k_offs = tl.arange(0, BLOCK_K)
    rows_mask = k_offs < K + 1
    target_row0 = target_probs_ptr + b * (K + 1) * V
    v_offs = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_K], float("-inf"), tl.float32)
    if FP64:
        best = best.to(tl.float64)
    best_idx = tl.zeros([BLOCK_K], dtype=tl.int64)
    lo = s * CHUNK
    for start in range(0, CHUNK, BLOCK_V):
        cols = lo + start + v_offs
        ptrs = target_row0 + k_offs[:, None].to(tl.int64) * V + cols[None, :]
        tile = _to_compute(tl.load(ptrs, mask=rows_mask[:, None] & (cols[None, :] < V), other=float("-inf")), FP64)
        blk_max, blk_idx = tl.max(tile, axis=1, return_indices=True, return_indices_tie_break_left=True)
        better = blk_max > best  # strict: earlier blocks keep ties
        best_idx = tl.where(better, blk_idx.to(tl.int64) + lo + start, best_idx)
        best = tl.where(better, blk_max, best)
    out = (b * S + s) * (K + 1) + k_offs
    tl.store(max_part_ptr + out, best, mask=rows_mask)
    tl.store(idx_part_ptr + out, best_idx, mask=rows_mask)


@triton.jit
def _split_greedy_kernel(
    draft_tokens_ptr, max_part_ptr, idx_part_ptr,
    num_accepted_ptr, next_tokens_ptr,  # [B] int64 out
    K, S,
    FP64: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    k_offs = tl.arange(0, BLOCK_K)
    s_offs = tl.arange(0, BLOCK_S)
    mask = (s_offs[:, None] < S) & (k_offs[None, :] < K + 1)
    at = (b * S + s_offs[:, None]) * (K + 1) + k_offs[None, :]
    maxima = tl.load(max_part_ptr + at, mask=mask, other=float("-inf"))  # [BLOCK_S, BLOCK_K]
    if FP64:
        maxima = maxima.to(tl.float64)
    columns = tl.load(idx_part_ptr + at, mask=mask, other=0)
    _, first_chunk = tl.max(maxima, axis=0, return_indices=True, return_indices_tie_break_left=True)
    argmax = tl.sum(tl.where(s_offs[:, None] == first_chunk[None, :], columns, 0), axis=0)  # [BLOCK_K]
    x = tl.load(draft_tokens_ptr + b * K + k_offs, mask=k_offs < K, other=0).to(tl.int64)
    rejected = (k_offs < K) & (x != argmax)
    n = tl.min(tl.where(rejected, k_offs, K), axis=0)
    tl.store(num_accepted_ptr + b, n.to(tl.int64))
    tl.store(next_tokens_ptr + b, tl.sum(tl.where(k_offs == n, argmax, 0), axis=0).to(tl.int64))


def split_block_v(V: int, splits: int, greedy_rows: int = 0) -> int:
    """Columns per block: the fused kernel's block, no larger than a chunk of ``V / splits`` (so that a
    small V still splits), and for greedy rows small enough for a ``[rows, block]`` tile."""
    block = min(_block_v(V), triton.next_power_of_2(triton.cdiv(V, splits)))
    if greedy_rows:
        block = min(block, 8192 // greedy_rows)
    return max(16, block)


def split_layout(V: int, splits: int, block_v: int) -> tuple[int, int]:
    """``(chunk, S)``: chunks of ``chunk`` columns (a multiple of ``block_v``), at most ``splits`` of
    them, covering V; fewer when V has fewer blocks than ``splits``."""
    blocks = triton.cdiv(V, block_v)
    per_chunk = triton.cdiv(blocks, max(1, min(splits, blocks)))
    chunk = per_chunk * block_v
    return chunk, triton.cdiv(V, chunk)


def chain_verify_split_triton(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                              target_probs: torch.Tensor, accept_uniforms: torch.Tensor,
                              sample_uniforms: torch.Tensor, greedy: bool = False, splits: int = 8
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the split-V kernels with up to ``splits`` programs per row (inputs checked by the dispatcher)."""
    B, K = draft_tokens.shape
    V = target_probs.shape[-1]
    device = target_probs.device
    num_accepted, next_tokens = output_buffers(B, device)
    if B == 0:
        return num_accepted, next_tokens
    fp64 = target_probs.dtype == torch.float64
    draft_tokens, draft_probs_arg, target_probs, accept_uniforms, sample_uniforms = launch_inputs(
        draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms)
    block_k = max(2, triton.next_power_of_2(K + 1))
    options = {"num_warps": 4, "enable_fp_fusion": False}  # same roundings as the torch reference
    if greedy:
        block_v = split_block_v(V, splits, greedy_rows=block_k)
        chunk, S = split_layout(V, splits, block_v)
        maxima = torch.empty(B, S, K + 1, dtype=torch.float64 if fp64 else torch.float32, device=device)
        columns = torch.empty(B, S, K + 1, dtype=torch.int64, device=device)
        _split_argmax_kernel[(B, S)](target_probs, maxima, columns, K, V, chunk, S, FP64=fp64, BLOCK_K=block_k,
                                     BLOCK_V=block_v, **options)
        _split_greedy_kernel[(B,)](draft_tokens, maxima, columns, num_accepted, next_tokens, K, S, FP64=fp64,
                                   BLOCK_K=block_k, BLOCK_S=max(2, triton.next_power_of_2(S)), **options)
        return num_accepted, next_tokens
    block_v = split_block_v(V, splits)
    chunk, S = split_layout(V, splits, block_v)
    residual_mass = torch.empty(B, S, dtype=torch.float64, device=device)
    target_mass = torch.empty(B, S, dtype=torch.float64, device=device)
    flags = {"HAS_DRAFT_PROBS": draft_probs is not None, "FP64": fp64, "BLOCK_K": block_k, "BLOCK_V": block_v}
    _split_mass_kernel[(B, S)](draft_tokens, draft_probs_arg, target_probs, accept_uniforms, num_accepted,
                               residual_mass, target_mass, K, V, chunk, S, **flags, **options)
    _split_sample_kernel[(B, S)](draft_tokens, draft_probs_arg, target_probs, accept_uniforms, sample_uniforms,
                                 residual_mass, target_mass, next_tokens, K, V, chunk, S, **flags,
                                 BLOCK_S=max(2, triton.next_power_of_2(S)), **options)
    return num_accepted, next_tokens
