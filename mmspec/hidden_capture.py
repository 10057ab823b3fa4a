"""Reading a transformers decoder's top and penultimate hidden states with forward hooks.

Feature-level drafters need at most two hidden states of the target per call: the top one (the
final-norm features the LM head reads; EAGLE-style heads) and the penultimate one (the input of the
last decoder layer; SpecVLM's gate). ``output_hidden_states=True`` makes transformers keep *every*
layer's output of the call instead, ``L + 1`` tensors ``[B, T, D]``; on a long multimodal prefill
(thousands of image or video tokens through a 28-layer model) that is over a gigabyte of activations
kept for no one. Two hooks read the two tensors as they pass and keep nothing else.

The hooks read exactly what transformers reports: the top hidden state is the decoder's
``last_hidden_state`` (``hidden_states[-1]``), the penultimate one the last decoder layer's input
(``hidden_states[-2]``); tests check both against ``output_hidden_states=True``.

Threads: a hook sits on a module that every thread using the model shares, so it also sees forwards that
other threads run while it is registered (two pipeline calls on one model). :func:`thread_scoped` makes a
hook fire only for forwards of the thread that registered it, so each call reads its own tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def find_decoder(model: Any) -> nn.Module | None:
    """The decoder stack of a transformers model (``model.get_decoder()`` with its ``layers``), or None for
    models that are not transformers ``PreTrainedModel``s or have another layout (the caller then falls
    back to ``output_hidden_states``)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a core dependency
        return None
    if not isinstance(model, PreTrainedModel) or not callable(getattr(model, "get_decoder", None)):
        return None
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(decoder, nn.Module) or not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return None
    return decoder


def thread_scoped(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` as a module hook that runs only for forwards of the calling thread (the one registering it).

    Why: hooks live on the shared model, so without this a forward that another thread runs meanwhile would
    overwrite what this call records (e.g. a decode step's ``[B, 1, D]`` embeddings replacing a prefill's
    ``[B, T, D]``). Other threads' forwards pass through untouched. The wrapper takes any trailing hook
    arguments: a thread that listed the hook just before its owner removed it may call it without the
    ``kwargs`` of a ``with_kwargs`` pre-hook (PyTorch reads the hook table and the kwargs table separately).
    """
    owner = threading.get_ident()

    def scoped(module: nn.Module, args: tuple, *rest: Any) -> Any:
        if threading.get_ident() != owner:
            return None
        return hook(module, args, *rest)

    return scoped


class HiddenStateCapture:
    """Forward hooks on one decoder that record its top and/or penultimate hidden states of a call (of the
    calling thread only: :func:`thread_scoped`; several threads may record on one decoder at once).

    Example::

        capture = HiddenStateCapture(find_decoder(model))
        with capture.recording(top=True, penultimate=False) as grabbed:
            logits = model(input_ids).logits
        grabbed["top"]  # [B, T, D], equal to model(..., output_hidden_states=True).hidden_states[-1]
    """

    def __init__(self, decoder: nn.Module) -> None:
        self.decoder = decoder
        self.last_layer: nn.Module = decoder.layers[-1]

    @contextmanager
    def recording(self, top: bool, penultimate: bool) -> Iterator[dict[str, torch.Tensor]]:
        """Hooks live only inside the ``with`` block; the yielded dict gains ``"top"`` and/or
        ``"penultimate"`` once the model has run."""
        grabbed: dict[str, torch.Tensor] = {}
        handles = []

        def read_top(module: nn.Module, args: tuple, output: Any) -> None:
            grabbed["top"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

        def read_penultimate(module: nn.Module, args: tuple, kwargs: dict) -> None:
            grabbed["penultimate"] = args[0] if args else kwargs["hidden_states"]

        if top:
            handles.append(self.decoder.register_forward_hook(thread_scoped(read_top)))
        if penultimate:
            handles.append(self.last_layer.register_forward_pre_hook(thread_scoped(read_penultimate),
                                                                     with_kwargs=True))
        try:
            yield grabbed
        finally:
            for handle in handles:
                handle.remove()
