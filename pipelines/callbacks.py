"""``callback_on_step_end`` in diffusers' convention, shared by every pipeline.

diffusers calls ``callback_on_step_end(pipeline, step_index, timestep, callback_kwargs)`` after each step,
where ``callback_kwargs`` holds the tensors named in ``callback_on_step_end_tensor_inputs`` (each must be in
the pipeline class's ``_callback_tensor_inputs``), and the callback returns a dict. Its own callback classes
(:class:`diffusers.callbacks.PipelineCallback`, :class:`~diffusers.callbacks.MultiPipelineCallbacks`) name
their tensors themselves (``tensor_inputs``). :class:`StepCallback` does that resolution and the checks once
per call, so a pipeline's loop only hands it the step's tensors.

Interrupting a call is diffusers' way too: a callback sets ``pipeline._interrupt = True`` and the call stops
after that step, returning what it has generated so far (:class:`PipelineInterrupted`, :class:`PartialTokens`).

A speculative step is a verification round (a block for video); its tensors describe what the round
committed and are read-only: the returned dict is checked (it must be one) but not fed back, because a
changed token would invalidate the drafts already verified. ``timestep`` is the pipeline's own measure of
progress (generated tokens for the token pipelines, the block index for video).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from mmspec.pipelines.generators import RowCallback


class PipelineInterrupted(Exception):  # noqa: N818 (a signal, not an error: the call returns partial output)
    """Raised by :meth:`StepCallback.stop_if_interrupted` at the end of a step once ``pipeline._interrupt`` is
    set; the pipeline catches it around its loop and returns the partial output."""


class StepCallback:
    """One call's ``callback_on_step_end`` with its tensor inputs resolved and checked.

    Args:
        pipeline: the pipeline passed to the callback as its first argument.
        callback: None, a callable ``fn(pipeline, step, timestep, callback_kwargs) -> dict`` or a diffusers
            ``PipelineCallback`` / ``MultiPipelineCallbacks`` (whose ``tensor_inputs`` are used).
        tensor_inputs: ``callback_on_step_end_tensor_inputs`` of the call (None: every tensor the pipeline
            offers, ``pipeline._callback_tensor_inputs``).

    Raises:
        ValueError: a callback that is not callable, or a tensor name the pipeline does not offer (named,
            with the names it offers).
    """

    def __init__(self, pipeline: Any, callback: Callable[..., Any] | None,
                 tensor_inputs: Sequence[str] | None = None) -> None:
        offered = list(getattr(type(pipeline), "_callback_tensor_inputs", ()))
        if callback is not None and not callable(callback):
            raise ValueError(f"callback_on_step_end must be callable or None, got {type(callback).__name__}")
        declared = getattr(callback, "tensor_inputs", None) if _is_diffusers_callback(callback) else None
        names = list(declared if declared is not None else (tensor_inputs if tensor_inputs is not None else offered))
        if isinstance(tensor_inputs, str) or not all(isinstance(name, str) for name in names):
            raise ValueError(f"callback_on_step_end_tensor_inputs must be a list of names, got {tensor_inputs!r}")
        unknown = [name for name in names if name not in offered]
        if unknown:
            raise ValueError(f"callback_on_step_end_tensor_inputs has {unknown}, which {type(pipeline).__name__} does "
                             f"not offer; it offers {offered}")
        self.pipeline, self.callback, self.tensor_inputs = pipeline, callback, names
        if not isinstance(callback, RowCallback):  # a new call starts uninterrupted (one output's call of a
            pipeline._interrupt = False           # call with a list of generators keeps the outer call's flag)

    @property
    def active(self) -> bool:
        return self.callback is not None

    def __call__(self, step: int, timestep: Any, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """Call the callback with the requested ``tensors`` of this step; returns its dict ({} without one)."""
        if self.callback is None:
            return {}
        result = self.callback(self.pipeline, step, timestep, {name: tensors[name] for name in self.tensor_inputs})
        if not isinstance(result, dict):
            raise TypeError(f"callback_on_step_end must return a dict (diffusers' convention: the callback_kwargs it "
                            f"was given, possibly changed), got {type(result).__name__}")
        return result

    @property
    def interrupted(self) -> bool:
        """Whether ``pipeline._interrupt`` is set (by the callback, as in diffusers): the loop should end."""
        return bool(getattr(self.pipeline, "_interrupt", False))

    def stop_if_interrupted(self) -> None:
        """Raise :class:`PipelineInterrupted` when ``pipeline._interrupt`` is set (by the callback, as in
        diffusers): the loop ends after the step that just finished."""
        if self.interrupted:
            raise PipelineInterrupted


class PartialTokens:
    """What a token loop committed so far, per row, from its per-step ``(new_tokens [B, M] (-1 pad),
    drafted [B, M])``: the output of an interrupted call (rows padded with ``pad_token_id``).

    Args:
        batch: rows of the call.
        max_new_tokens: the most tokens a row can have.
        pad_token_id: the token written past each row's end.
    """

    def __init__(self, batch: int, max_new_tokens: int, pad_token_id: int) -> None:
        self.batch, self.max_new_tokens, self.pad_token_id = batch, max_new_tokens, pad_token_id
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, new_tokens: torch.Tensor, drafted: torch.Tensor) -> None:
        """Keep one step's tensors (no host work: they are assembled only if the call is interrupted)."""
        self.steps.append((new_tokens.detach().clone(), drafted.detach().clone()))

    def output(self, stats: Any, device: torch.device | str = "cpu") -> Any:
        """A :class:`~mmspec.speculate.SpeculativeOutput` of the tokens so far (``sequences`` and ``drafted``
        ``[B, max_new_tokens]``, ``lengths`` the tokens each row has; the -1 padding of the steps left out)
        with ``stats``."""
        from mmspec.speculate import SpeculativeOutput

        sequences = torch.full((self.batch, self.max_new_tokens), self.pad_token_id, dtype=torch.long)
        drafted = torch.zeros(self.batch, self.max_new_tokens, dtype=torch.bool)
        lengths = torch.zeros(self.batch, dtype=torch.long)
        for new_tokens, flags in self.steps:
            for row in range(self.batch):
                kept = new_tokens[row] >= 0
                tokens, row_flags = new_tokens[row][kept].cpu(), flags[row][kept].cpu()
                start = int(lengths[row])
                count = min(tokens.numel(), self.max_new_tokens - start)
                sequences[row, start:start + count] = tokens[:count]
                drafted[row, start:start + count] = row_flags[:count]
                lengths[row] = start + count
        return SpeculativeOutput(sequences.to(device), lengths.to(device), drafted.to(device), stats)


def _is_diffusers_callback(callback: Any) -> bool:
    try:
        from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
    except ImportError:  # pragma: no cover - diffusers is a dependency
        return False
    return isinstance(callback, (PipelineCallback, MultiPipelineCallbacks))
