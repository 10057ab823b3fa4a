"""Kernels of the mmspec core, with dispatch between Triton and the torch reference.

* :func:`chain_verify`: fused verification of a chain of K drafts (acceptance tests, first
  rejection, residual or bonus sample), the hot path of ``mmspec.verify_tokens`` for the exact and
  greedy rules.
* :func:`neighborhood_mass`: target mass over the k codebook neighbours of tokens, the relaxation of
  LANTERN (budgeted prefix c_J) and the pooled acceptance of MuLo-SD (total).

Dispatch (:func:`kernel_backend`): Triton when the tensor is on CUDA and triton is importable, the
torch reference otherwise. ``MMSPEC_KERNEL_BACKEND=torch|triton|auto`` (read at every call) overrides
the choice; forcing ``triton`` for CPU tensors needs ``TRITON_INTERPRET=1`` (the Triton interpreter,
used by the tests). A ``backend=`` argument on each call overrides both.

Triton is imported lazily inside the Triton path, so ``import mmspec`` works without triton installed.
See docs/kernels.md for the formulas and the benchmark.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from mmspec.kernels.reference import (
    RESIDUAL_EPS,
    chain_verify_reference,
    chain_verify_torch,
    check_chain_inputs,
    check_neighborhood_inputs,
    neighborhood_mass_reference,
    neighborhood_mass_torch,
)

__all__ = [
    "RESIDUAL_EPS",
    "chain_verify",
    "chain_verify_reference",
    "kernel_backend",
    "neighborhood_mass",
    "neighborhood_mass_reference",
    "triton_available",
]

BACKEND_ENV = "MMSPEC_KERNEL_BACKEND"
_BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    """Whether triton can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["triton"] = None, or a broken install
        return False


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def kernel_backend(tensor: torch.Tensor, backend: str | None = None) -> str:
    """The backend ("triton" or "torch") that kernels use for inputs living where ``tensor`` lives.

    ``backend`` (or else the ``MMSPEC_KERNEL_BACKEND`` environment variable) may be "auto" (default),
    "torch" or "triton". Auto picks Triton for CUDA tensors when triton is importable.
    """
    choice = backend if backend is not None else os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if choice not in _BACKENDS:
        source = "backend" if backend is not None else BACKEND_ENV
        raise ValueError(f"{source} must be one of {', '.join(_BACKENDS)}, got {choice!r}")
    if choice == "auto":
        return "triton" if tensor.is_cuda and triton_available() else "torch"
    return choice


def _require_triton(tensor: torch.Tensor) -> None:
    if not triton_available():
        raise ImportError("the Triton kernel backend was requested but triton is not installed "
                          "(pip install triton, or set MMSPEC_KERNEL_BACKEND=torch)")
    if not tensor.is_cuda and not _interpreting():
        raise RuntimeError(f"Triton kernels need CUDA tensors (got {tensor.device}); set TRITON_INTERPRET=1 "
                           "before importing mmspec.kernels' Triton modules to run them on CPU through the "
                           "Triton interpreter, or use MMSPEC_KERNEL_BACKEND=torch")


def chain_verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                 accept_uniforms: torch.Tensor, sample_uniforms: torch.Tensor, greedy: bool = False, *,
                 backend: str | None = None, check_values: bool = True, splits: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify K drafts per row and draw the next token; Triton on CUDA, the torch reference elsewhere.

    Args:
        draft_tokens: LongTensor ``[B, K]``.
        draft_probs: ``[B, K, V]`` or None (deterministic drafts: q is a point mass at the draft token).
        target_probs: ``[B, K+1, V]``; row K gives the bonus token.
        accept_uniforms: ``[B, K]`` in [0, 1); sample_uniforms: ``[B]`` in [0, 1).
        greedy: accept iff the draft is the target's argmax; the next token is the argmax.
        backend: "auto" / "torch" / "triton", overriding ``MMSPEC_KERNEL_BACKEND``.
        check_values: run the value checks (token and uniform ranges); the shape checks always run.
            Pass False only for inputs validated upstream (e.g. by ``verify_tokens``).
        splits: Triton only: cut each row's vocabulary into up to this many chunks, one program each
            (:mod:`~mmspec.kernels.chain_verify_split_triton`, for few rows on a large GPU); None or 1:
            one program per row. The torch reference does not split (the argument changes nothing there).

    Returns:
        ``(num_accepted [B], next_tokens [B])`` LongTensors. See :func:`chain_verify_reference` for the
        exact semantics; both backends pick the same tokens for the same uniforms.
    """
    check_chain_inputs(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms, greedy,
                       check_values=check_values)
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int) or splits < 1):
        raise ValueError(f"splits must be a positive integer or None, got {splits!r}")
    if kernel_backend(target_probs, backend) == "triton":
        _require_triton(target_probs)
        if splits is not None and splits > 1:
            from mmspec.kernels.chain_verify_split_triton import chain_verify_split_triton

            return chain_verify_split_triton(draft_tokens, draft_probs, target_probs, accept_uniforms,
                                             sample_uniforms, greedy, splits)
        from mmspec.kernels.chain_verify_triton import chain_verify_triton

        return chain_verify_triton(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms,
                                   greedy)
    return chain_verify_torch(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms, greedy)


def neighborhood_mass(probs: torch.Tensor, tokens: torch.Tensor, neighbors: torch.Tensor,
                      budget: torch.Tensor | None = None, *, backend: str | None = None,
                      check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mass of ``probs`` on the codebook neighbours of ``tokens``: ``(total [N, M], prefix [N, M] | None)``.

    Args:
        probs: ``[N, V]``; tokens: LongTensor ``[N, M]``; neighbors: LongTensor ``[V, k]`` (row t: the
            k nearest other codebook entries of t by distance, -1 = padding); budget: ``[N, M]`` or None.
        backend, check_values: as in :func:`chain_verify`.

    Returns:
        ``total`` (sum over the valid neighbours) and ``prefix`` (LANTERN's c_J: the mass of the longest
        distance-ordered prefix with cumulative mass <= budget), or None for ``prefix`` when no budget
        is given. Float32 results (float64 for float64 probs). See
        :func:`neighborhood_mass_reference`.
    """
    check_neighborhood_inputs(probs, tokens, neighbors, budget, check_values=check_values)
    if kernel_backend(probs, backend) == "triton":
        _require_triton(probs)
        from mmspec.kernels.neighborhood_mass_triton import neighborhood_mass_triton

        return neighborhood_mass_triton(probs, tokens, neighbors, budget)
    return neighborhood_mass_torch(probs, tokens, neighbors, budget)
