"""Plain-torch references of the mmspec kernels: the specification the Triton kernels are tested against.

Each function here is the readable definition of what a kernel computes; it runs on any device and
accepts float16/bfloat16/float32/float64 inputs (half precisions are upcast to float32 first, exactly
as the kernels do). ``mmspec.kernels`` dispatches to these on CPU.

Two kernels:

* :func:`chain_verify_reference` verifies a chain of K draft tokens against the target in one call:
  acceptance test per position, first rejection, and one residual (or bonus) sample drawn by
  inverse-CDF from given uniforms (lossless speculative sampling, Leviathan et al. 2023,
  https://arxiv.org/abs/2211.17192; greedy argmax matching when ``greedy=True``).
* :func:`neighborhood_mass_reference` sums target probability over the k codebook neighbours of
  tokens (LANTERN, https://arxiv.org/abs/2410.03355; MuLo-SD pooled acceptance,
  https://arxiv.org/abs/2601.05149), plus the LANTERN budgeted prefix mass c_J.
"""

from __future__ import annotations

import torch

from mmspec.sampling import first_argmax, sample_inverse_cdf
from mmspec.validation import check_ndim, check_token_ids, checks_enabled

# Residual mass at or below this counts as "no residual": the draft already covers the target
# (p == q up to rounding) and the corrected token is drawn from the target row instead.
RESIDUAL_EPS = 1e-9

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels compute in: float64 stays float64, everything else becomes float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------
# Input checks (shared by the reference and the Triton path; run once by the dispatcher)
# ----------------------------------------------------------------------------------------------


def _check_float(tensor: torch.Tensor, name: str) -> None:
    if tensor.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {tensor.dtype}")


def _check_uniforms(uniforms: torch.Tensor, name: str) -> None:
    # 1.0 itself is let through: uniforms drawn in float64 and cast to float32 (or bf16) round up to 1.0
    # now and then, and raising on such a draw would crash long decoding runs at random.
    if uniforms.numel() and (uniforms.min() < 0 or uniforms.max() > 1):
        raise ValueError(f"{name} must lie in [0, 1), got values in "
                         f"[{uniforms.min().item():.4g}, {uniforms.max().item():.4g}]")


def check_chain_inputs(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                       target_probs: torch.Tensor, accept_uniforms: torch.Tensor,
                       sample_uniforms: torch.Tensor, greedy: bool, check_values: bool = True) -> None:
    """Raise a ``ValueError`` naming the argument when the inputs of ``chain_verify`` do not fit together.

    Shapes, dtypes and devices are always checked. Token ranges and uniform ranges (reductions, one
    host sync each) only when ``check_values`` and :func:`mmspec.validation.checks_enabled`; out-of-range
    token ids would make the Triton kernel read out of bounds, so only switch them off for inputs that
    were validated upstream.
    """
    check_ndim(draft_tokens, 2, "draft_tokens", "[B, K]")
    check_ndim(target_probs, 3, "target_probs", "[B, K+1, V]")
    if draft_tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_tokens must be an integer tensor of token ids, got {draft_tokens.dtype}")
    _check_float(target_probs, "target_probs")
    B, K = draft_tokens.shape
    if target_probs.shape[:2] != (B, K + 1):
        raise ValueError(f"target_probs must have shape [B, K+1, V] = [{B}, {K + 1}, V] for draft_tokens "
                         f"{tuple(draft_tokens.shape)}, got {tuple(target_probs.shape)}")
    V = target_probs.shape[2]
    if V == 0:
        raise ValueError("target_probs has an empty vocabulary dimension (V = 0)")
    if draft_probs is not None:
        check_ndim(draft_probs, 3, "draft_probs", "[B, K, V]")
        if draft_probs.shape != (B, K, V):
            raise ValueError(f"draft_probs must have shape [B, K, V] = [{B}, {K}, {V}], "
                             f"got {tuple(draft_probs.shape)}")
        if draft_probs.dtype != target_probs.dtype:
            raise ValueError(f"draft_probs ({draft_probs.dtype}) and target_probs ({target_probs.dtype}) "
                             "must have the same dtype")
    check_ndim(accept_uniforms, 2, "accept_uniforms", "[B, K]")
    check_ndim(sample_uniforms, 1, "sample_uniforms", "[B]")
    if accept_uniforms.shape != (B, K):
        raise ValueError(f"accept_uniforms must have shape [B, K] = [{B}, {K}], "
                         f"got {tuple(accept_uniforms.shape)}")
    if sample_uniforms.shape != (B,):
        raise ValueError(f"sample_uniforms must have shape [B] = [{B}], got {tuple(sample_uniforms.shape)}")
    _check_float(accept_uniforms, "accept_uniforms")
    _check_float(sample_uniforms, "sample_uniforms")
    named = {"draft_tokens": draft_tokens, "draft_probs": draft_probs, "accept_uniforms": accept_uniforms,
             "sample_uniforms": sample_uniforms}
    for name, tensor in named.items():
        if tensor is not None and tensor.device != target_probs.device:
            raise ValueError(f"{name} is on {tensor.device} but target_probs is on {target_probs.device}")
    if check_values and checks_enabled():
        check_token_ids(draft_tokens, V, "draft_tokens")
        if not greedy:
            _check_uniforms(accept_uniforms, "accept_uniforms")
            _check_uniforms(sample_uniforms, "sample_uniforms")


def check_neighborhood_inputs(probs: torch.Tensor, tokens: torch.Tensor, neighbors: torch.Tensor,
                              budget: torch.Tensor | None, check_values: bool = True) -> None:
    """Raise a ``ValueError`` naming the argument when the inputs of ``neighborhood_mass`` do not fit."""
    check_ndim(probs, 2, "probs", "[N, V]")
    check_ndim(tokens, 2, "tokens", "[N, M]")
    check_ndim(neighbors, 2, "neighbors", "[V, k]")
    _check_float(probs, "probs")
    for name, tensor in (("tokens", tokens), ("neighbors", neighbors)):
        if tensor.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name} must be an integer tensor of token ids, got {tensor.dtype}")
    N, V = probs.shape
    if tokens.shape[0] != N:
        raise ValueError(f"tokens must have shape [N, M] with N = {N} rows like probs, got {tuple(tokens.shape)}")
    if neighbors.shape[0] != V:
        raise ValueError(f"neighbors must have one row per vocabulary entry ([V, k] with V = {V}), "
                         f"got {tuple(neighbors.shape)}")
    if budget is not None:
        if not isinstance(budget, torch.Tensor) or budget.shape != tokens.shape:
            shape = tuple(budget.shape) if isinstance(budget, torch.Tensor) else type(budget).__name__
            raise ValueError(f"budget must be a tensor shaped like tokens {tuple(tokens.shape)}, got {shape}")
        _check_float(budget, "budget")
    for name, tensor in (("tokens", tokens), ("neighbors", neighbors), ("budget", budget)):
        if tensor is not None and tensor.device != probs.device:
            raise ValueError(f"{name} is on {tensor.device} but probs is on {probs.device}")
    if check_values and checks_enabled():
        check_token_ids(tokens, V, "tokens")
        if neighbors.numel() and (neighbors.min() < -1 or neighbors.max() >= V):
            raise ValueError(f"neighbors must hold token ids in [0, {V}) or -1 for padding "
                             f"(min {neighbors.min().item()}, max {neighbors.max().item()})")


# ----------------------------------------------------------------------------------------------
# Chain verification
# ----------------------------------------------------------------------------------------------


def chain_verify_reference(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                           target_probs: torch.Tensor, accept_uniforms: torch.Tensor,
                           sample_uniforms: torch.Tensor, greedy: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a chain of K drafts per row: accept a prefix, then draw the corrected or bonus token.

    Args:
        draft_tokens: LongTensor ``[B, K]``, the drafted tokens x_0..x_{K-1}.
        draft_probs: ``[B, K, V]`` distributions the drafts were sampled from, or None for
            deterministic drafts (q is the point mass at the draft token, so q(x_i) = 1).
        target_probs: ``[B, K+1, V]``; row i is the target distribution for draft i, row K gives the
            bonus token when all K drafts are accepted.
        accept_uniforms: ``[B, K]`` in [0, 1), one per acceptance test.
        sample_uniforms: ``[B]`` in [0, 1), one per inverse-CDF draw.
        greedy: argmax matching instead of speculative sampling (the uniforms are then ignored).

    Returns:
        ``(num_accepted [B], next_tokens [B])`` as LongTensors: the number n of leading accepted drafts
        and the token that follows them (residual sample at the first rejection, or the bonus token).

    Sampling: draft i is accepted iff ``u_i * q(x_i) < p(x_i)`` (u < min(1, p/q) without a division,
    p = 0 never accepts). At the first rejection n the next token is drawn from
    ``w = max(0, p_n - q_n)`` (the target row when sum(w) <= 1e-9); after K acceptances from p_K.
    """
    check_chain_inputs(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms, greedy)
    return chain_verify_torch(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms, greedy)


def chain_verify_torch(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                       target_probs: torch.Tensor, accept_uniforms: torch.Tensor,
                       sample_uniforms: torch.Tensor, greedy: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chain_verify_reference` without the input checks (the dispatcher checks once)."""
    B, K = draft_tokens.shape
    cdtype = compute_dtype(target_probs.dtype)
    target_probs = target_probs.to(cdtype)
    draft_tokens = draft_tokens.long()
    rows = torch.arange(B, device=target_probs.device)

    # 1. Acceptance test per draft position.
    if greedy:
        accepted = draft_tokens == first_argmax(target_probs[:, :K])  # [B, K]
    else:
        p = target_probs[:, :K].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, K]
        if draft_probs is None:
            q = torch.ones_like(p)
        else:
            q = draft_probs.to(cdtype).gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, K]
        accepted = accept_uniforms.to(cdtype) * q < p

    # 2. n = length of the accepted prefix (the first rejection, or K).
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # [B]
    dist = target_probs[rows, num_accepted]  # [B, V]: p_n, or p_K for the bonus token
    if greedy:
        return num_accepted, first_argmax(dist)

    # 3. Residual max(0, p_n - q_n) at a rejection; the target row itself for the bonus token or when
    #    the residual vanishes (p == q).
    rejected = num_accepted < K
    if K > 0:
        at = num_accepted.clamp(max=K - 1)
        if draft_probs is None:
            q_n = torch.nn.functional.one_hot(draft_tokens[rows, at], dist.shape[-1]).to(cdtype)
        else:
            q_n = draft_probs[rows, at].to(cdtype)
        residual = (dist - q_n).clamp_min(0)  # [B, V]
        use_residual = rejected & (residual.sum(-1) > RESIDUAL_EPS)
        weights = torch.where(use_residual.unsqueeze(-1), residual, dist)
    else:
        weights = dist
    return num_accepted, sample_inverse_cdf(weights, sample_uniforms.to(cdtype))


# ----------------------------------------------------------------------------------------------
# Neighbourhood mass
# ----------------------------------------------------------------------------------------------

# Elements of the gathered [N, chunk, k] mass block in one step of the reference (bounds its memory).
_GATHER_CHUNK = 1 << 22


def neighborhood_mass_reference(probs: torch.Tensor, tokens: torch.Tensor, neighbors: torch.Tensor,
                                budget: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Target mass on the codebook neighbours of tokens: the pooled total and the budgeted prefix.

    Args:
        probs: ``[N, V]`` target distributions (one row per verified position).
        tokens: LongTensor ``[N, M]``, M tokens per row whose neighbourhoods are measured.
        neighbors: LongTensor ``[V, k]``; row t lists the k nearest *other* codebook entries of token t
            ordered by distance, -1 marks padding (contributes nothing).
        budget: ``[N, M]`` mass budget per token (LANTERN: delta, or (lam-1) p(x) for LANTERN++),
            or None.

    Returns:
        ``(total [N, M], prefix [N, M] or None)`` in the compute dtype (float32, float64 for float64
        probs). ``total = sum_j probs[n, neighbors[t, j]]`` over valid j (MuLo-SD pooled mass minus
        p(t) itself). ``prefix`` is c_J, the mass of the longest distance-ordered prefix of the
        neighbours whose cumulative mass stays <= budget (padding adds zero mass and does not end the
        prefix); None when ``budget`` is None.
    """
    check_neighborhood_inputs(probs, tokens, neighbors, budget)
    return neighborhood_mass_torch(probs, tokens, neighbors, budget)


def neighborhood_mass_torch(probs: torch.Tensor, tokens: torch.Tensor, neighbors: torch.Tensor,
                            budget: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`neighborhood_mass_reference` without the input checks; works in chunks of M."""
    N, M = tokens.shape
    k = neighbors.shape[1]
    cdtype = compute_dtype(probs.dtype)
    probs = probs.to(cdtype)
    total = probs.new_zeros(N, M)
    prefix = probs.new_zeros(N, M) if budget is not None else None
    if N == 0 or M == 0 or k == 0:
        return total, prefix
    chunk = max(1, _GATHER_CHUNK // max(1, N * k))
    for start in range(0, M, chunk):
        stop = min(M, start + chunk)
        nb = neighbors[tokens[:, start:stop].long()].long()  # [N, m, k]
        valid = nb >= 0
        mass = probs.gather(1, nb.clamp_min(0).flatten(1)).view_as(nb)  # [N, m, k]
        mass = torch.where(valid, mass, torch.zeros((), dtype=cdtype, device=mass.device))
        total[:, start:stop] = mass.sum(-1)
        if budget is not None:
            cum = mass.cumsum(-1)  # [N, m, k], non-decreasing
            within = cum <= budget[:, start:stop].to(cdtype).unsqueeze(-1)
            length = within.long().cumprod(-1).sum(-1, keepdim=True)  # J, the prefix length
            c_j = cum.gather(-1, (length - 1).clamp_min(0)).squeeze(-1)
            prefix[:, start:stop] = torch.where(length.squeeze(-1) > 0, c_j, torch.zeros_like(c_j))
    return total, prefix
