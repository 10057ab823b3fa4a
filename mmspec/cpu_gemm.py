"""Prepacked oneDNN GEMMs for the ``nn.Linear`` layers of models that decode on a CPU.

Why: speculative decoding is fast when verifying K drafted tokens costs about what one target token
costs. On the AMD CPU these benchmarks run on, PyTorch's default fp32 ``F.linear`` (MKL) does not
behave like that: its time grows about linearly with the rows of a call already from 2 rows on
(measured), so a verification forward of 2 x 13 rows (CFG doubles the batch) costs about twice a
single-token forward. oneDNN (``torch.ops.mkldnn``, the library PyTorch already uses for bf16 and for
``torch.compile``'s CPU kernels), on a weight reordered once into its blocked layout, costs a fixed
~10-15 us per call more on tiny calls, but from a few hundred thousand multiply-adds on it is faster:
1.5-2.6x on the shapes zoo's layers at 16-64 rows and up to 7x on large ones (``python -m
mmspec.evaluation.bench_gemm`` prints the table for the machine it runs on).

:func:`pack_cpu_linears` therefore routes each call of a packed layer by its size: calls of at least
``min_macs`` multiply-adds (rows x in x out) run the packed oneDNN kernel, smaller ones keep ``F.linear``.
The routing depends only on shapes, so results are deterministic;
both kernels compute in fp32 and differ only by rounding (about 1e-6 relative), as MKL's own results
already differ between row counts.
Applied to a pipeline it speeds up every method that calls a model with several rows at once (the
verification forwards, prefills) and leaves the single-token baseline on the kernel that is fastest for it.

Only float32 ``nn.Linear`` layers on the CPU, outside autograd, take the packed path; anything else
(bf16 weights, which PyTorch already sends to oneDNN, CUDA tensors, training) falls back to ``F.linear``.
The packed copy is rebuilt when the weight is replaced or changed in place, and removed by
:meth:`PackedLinears.remove`. State dicts, ``save_pretrained`` and ``deepcopy`` are unaffected.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: calls of at least this many multiply-adds (rows x in_features x out_features) use the packed kernel:
#: about where the two kernels cost the same on the benchmark machine at 1 and 2 threads (e.g. 4 rows of
#: a 192 -> 512 layer, 2 rows of a 192 -> 2048 one); see ``evaluation/bench_gemm.py``
DEFAULT_MIN_MACS = 400_000
#: the row count oneDNN is told to expect when it reorders a weight (a hint for its blocking; any row
#: count gives the same results)
_PACK_ROWS_HINT = 16
_STATE = "_mmspec_packed_gemm"
#: the ``cpu_gemm`` settings of the pipelines, the command line and the benchmarks: ``"packed"`` (large fp32
#: CPU matmuls as packed oneDNN GEMMs) or ``"plain"`` (PyTorch's default ``F.linear``)
CPU_GEMM_MODES = ("packed", "plain")


@dataclass
class _PackState:
    """A layer's packed weight and what it was packed from (so an updated weight is repacked). Copies and
    pickles drop the packed tensor (an opaque oneDNN tensor): it is rebuilt on the next large call."""

    min_macs: int
    source: tuple[int, int] = (-1, -1)  # (data_ptr, version) of the weight the packed copy reflects
    packed: torch.Tensor | None = None

    def __deepcopy__(self, memo: dict) -> _PackState:
        return _PackState(self.min_macs)

    def __getstate__(self) -> dict[str, Any]:
        return {"min_macs": self.min_macs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["min_macs"])


def onednn_linear_available() -> bool:
    """Whether this PyTorch build has oneDNN's packed linear ops (x86 and most ARM builds do)."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight")


def _packable(module: nn.Module) -> bool:
    """Plain fp32 linears on the CPU (subclasses, e.g. attention's out-projection, keep their own forward)."""
    return type(module) is nn.Linear and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu"


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` (fp32, CPU) reordered into oneDNN's blocked layout (an opaque tensor) for
    :func:`onednn_linear`."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight.default(weight.detach(), _PACK_ROWS_HINT)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` with oneDNN's kernel on ``packed = pack_weight(W)``; no autograd."""
    # the op overload itself: cheaper to call than the op packet
    return torch.ops.mkldnn._linear_pointwise.default(x.contiguous(), packed, bias, "none", [], "")


def _packed_weight(weight: torch.Tensor, state: _PackState) -> torch.Tensor:
    # inference tensors (e.g. weights derived inside torch.inference_mode) keep no version counter
    source = (weight.data_ptr(), 0 if weight.is_inference() else weight._version)
    if state.packed is None or state.source != source:
        state.packed, state.source = pack_weight(weight), source
    return state.packed


def _routed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: _PackState
                   ) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on the packed kernel when the call is large enough and packable."""
    # cheapest checks first: this runs for every linear call of a decoding loop
    if (x.numel() * weight.shape[0] < state.min_macs or x.dtype is not torch.float32
            or weight.dtype is not torch.float32 or not x.is_cpu or not weight.is_cpu
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    # (no autograd here: grad mode is off or nothing requires grad, so the op needs no detached inputs)
    return onednn_linear(x, _packed_weight(weight, state), bias)


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose large fp32 CPU calls run a packed oneDNN GEMM. :func:`pack_cpu_linears` turns
    existing layers into this class in place (same parameters and state-dict keys) and back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _routed_linear(x, self.weight, self.bias, self.__dict__[_STATE])


class LinearRoute:
    """``F.linear`` for a weight derived from linear layers (e.g. several projections concatenated into one
    matmul), routed as those layers are: the packed kernel for large calls while ``like`` is packed,
    ``F.linear`` otherwise. Keeps the derived weight's packed copy (rebuilt when the weight changes; copies
    and pickles drop it, as :class:`_PackState` does)."""

    def __init__(self) -> None:
        self._state: _PackState | None = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, like: nn.Module
                 ) -> torch.Tensor:
        if not isinstance(like, PackedLinear):
            return F.linear(x, weight, bias)
        min_macs = like.__dict__[_STATE].min_macs
        if self._state is None or self._state.min_macs != min_macs:
            self._state = _PackState(min_macs)
        return _routed_linear(x, weight, bias, self._state)


@dataclass
class PackedLinears:
    """The layers :func:`pack_cpu_linears` packed; :meth:`remove` turns them back into plain ``nn.Linear``."""

    layers: list[nn.Linear] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.layers)

    def remove(self) -> None:
        for layer in self.layers:
            if is_packed(layer):
                layer.__class__ = nn.Linear
                del layer.__dict__[_STATE]
        self.layers.clear()


def is_packed(module: nn.Module) -> bool:
    """Whether ``module`` is a linear layer that :func:`pack_cpu_linears` packed (and not removed since)."""
    return isinstance(module, PackedLinear)


def pack_cpu_linears(modules: nn.Module | Iterable[nn.Module], min_macs: int = DEFAULT_MIN_MACS) -> PackedLinears:
    """Route the fp32 CPU ``nn.Linear`` layers of ``modules`` (and their children) through packed oneDNN
    GEMMs for calls of at least ``min_macs`` multiply-adds; see the module docstring for why and when.

    Layers already packed keep their packing (and are not returned again). Weights are reordered lazily,
    on a layer's first large call. Returns the newly packed layers (empty when this PyTorch build has no
    oneDNN linear ops: nothing changes then).
    """
    if isinstance(min_macs, bool) or not isinstance(min_macs, int) or min_macs < 0:
        raise ValueError(f"min_macs must be a non-negative int, got {min_macs!r}")
    if isinstance(modules, nn.Module):
        modules = [modules]
    handle = PackedLinears()
    if not onednn_linear_available():
        return handle
    for root in modules:
        if not isinstance(root, nn.Module):
            raise TypeError(f"pack_cpu_linears takes nn.Module objects, got {type(root).__name__}")
        for layer in root.modules():
            if _packable(layer) and not is_packed(layer):
                layer.__dict__[_STATE] = _PackState(min_macs)
                layer.__class__ = PackedLinear
                handle.layers.append(layer)
    return handle


def add_cpu_gemm_argument(parser: argparse.ArgumentParser) -> None:
    """``--cpu-gemm plain|packed`` (default plain, what a pipeline call does) for the command lines that load
    pipelines."""
    parser.add_argument("--cpu-gemm", choices=CPU_GEMM_MODES, default="plain",
                        help="plain (default, as a pipeline call): PyTorch's F.linear; packed: an opt-in CPU "
                             "speed-up, large fp32 CPU matmuls run as prepacked oneDNN GEMMs for every method and "
                             "the baseline (pipe.enable_packed_cpu_gemm(), mmspec.cpu_gemm)")


def pipeline_modules(pipeline: Any) -> list[nn.Module]:
    """The ``nn.Module`` components of a diffusers-style pipeline (its ``components`` dict)."""
    return [module for module in getattr(pipeline, "components", {}).values() if isinstance(module, nn.Module)]


class PackedCPUGemmMixin:
    """``enable_packed_cpu_gemm()`` / ``disable_packed_cpu_gemm()`` for the pipelines (see :mod:`mmspec.cpu_gemm`)."""

    def enable_packed_cpu_gemm(self, min_macs: int = DEFAULT_MIN_MACS) -> int:
        """Pack the fp32 CPU linears of every model component (an opt-in CPU speed-up for all methods,
        the ``"none"`` baseline included; on a GPU it changes nothing). Returns how many layers it packed
        now; calling it again packs only layers added since."""
        return len(pack_cpu_linears(pipeline_modules(self), min_macs))

    def disable_packed_cpu_gemm(self) -> None:
        """Restore the plain ``F.linear`` path of every packed layer of the model components."""
        PackedLinears(list(self._packed_layers())).remove()

    def _packed_layers(self) -> Iterator[nn.Linear]:
        return (layer for module in pipeline_modules(self) for layer in module.modules() if is_packed(layer))

    def set_cpu_gemm(self, mode: str) -> None:
        """``"packed"``: :meth:`enable_packed_cpu_gemm`; ``"plain"``: :meth:`disable_packed_cpu_gemm`."""
        if mode not in CPU_GEMM_MODES:
            raise ValueError(f"cpu_gemm must be one of {CPU_GEMM_MODES}, got {mode!r}")
        if mode == "packed":
            self.enable_packed_cpu_gemm()
        else:
            self.disable_packed_cpu_gemm()

    @property
    def packed_cpu_gemm(self) -> bool:
        """Whether any layer of the pipeline is packed now."""
        return next(self._packed_layers(), None) is not None
