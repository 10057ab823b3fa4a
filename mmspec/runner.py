"""Running a transformers causal LM round by round with a KV cache that can be rolled back per row.

:class:`CausalLMRunner` is the target interface of :mod:`mmspec.speculate` for any
``*ForCausalLM``-style model (it also serves as the engine of model-based drafters). A round appends
slots (the pending token plus drafts, or a tree), then :meth:`CausalLMRunner.commit` keeps the accepted
ones. Batches use the pad-and-mask scheme of :mod:`mmspec.cache`, so rows may keep different numbers
of tokens.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from mmspec.cache import SlotState, crop_cache, kept_width, move_cache_slots, rows_keep_prefix
from mmspec.hidden_capture import HiddenStateCapture, find_decoder
from mmspec.validation import check_ndim

#: what a prefill returns logits for: the last slot only (all a decoding loop reads) or every slot
PREFILL_LOGITS = ("last", "all")
#: how hidden states are read: forward hooks on the decoder (transformers models) or the model's
#: ``output_hidden_states`` (every layer's output; the fallback for models the hooks cannot find)
READ_HIDDEN = ("hooks", "output_hidden_states")


@dataclass
class StepOutput:
    """Logits ``[B, T, V]`` of the slots a forward appended (a prefill's: ``[B, 1, V]``, the last slot, unless
    the runner keeps them all) and, when asked, the top hidden states ``[B, T, D]`` of every slot (what
    EAGLE-style drafters read)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


def prompt_attention_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The attention mask of a prompt ``input_ids [B, T]`` (all ones when None), checked against it."""
    check_ndim(input_ids, 2, "input_ids", "[B, T]")
    if attention_mask is None:
        return torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    return attention_mask


class CausalLMRunner:
    """Target interface over a transformers causal LM.

    Args:
        model: a ``PreTrainedModel`` returning ``logits`` (and ``hidden_states`` when asked) that accepts
            ``past_key_values``, ``position_ids`` and 2-D or 4-D ``attention_mask``.
        return_hidden: also return the last layer's hidden states (for feature-level drafters).
        prefill_logits: ``"last"`` (default): the prefill returns logits ``[B, 1, V]`` for the last prompt
            slot only, which is all decoding reads; models that take transformers' ``logits_to_keep``
            compute no others (a 5,000-token video prompt of a 152k-vocabulary model would otherwise
            materialise 3 GB of fp32 logits). ``"all"``: ``[B, T, V]`` for every prompt slot (distillation).
        read_hidden: ``"hooks"`` (default): hidden states of transformers models are read by two forward
            hooks (:mod:`mmspec.hidden_capture`); other models, whose decoder the hooks cannot find, use
            ``output_hidden_states``. ``"output_hidden_states"`` forces the latter, which keeps every
            layer's output of the call (the memory the hooks save: ``evaluation/prefill_memory.py``).
    """

    def __init__(self, model: Any, return_hidden: bool = False, prefill_logits: str = "last",
                 read_hidden: str = "hooks") -> None:
        if prefill_logits not in PREFILL_LOGITS:
            raise ValueError(f"prefill_logits must be one of {PREFILL_LOGITS}, got {prefill_logits!r}")
        if read_hidden not in READ_HIDDEN:
            raise ValueError(f"read_hidden must be one of {READ_HIDDEN}, got {read_hidden!r}")
        self.model = model
        self.return_hidden = return_hidden
        self.prefill_logits = prefill_logits
        decoder = find_decoder(model) if read_hidden == "hooks" else None
        self._capture = HiddenStateCapture(decoder) if decoder is not None else None
        forward = getattr(model, "forward", None)
        self._takes_logits_to_keep = forward is not None and \
            "logits_to_keep" in inspect.signature(forward).parameters
        self.cache: Any = None
        self.slots: SlotState | None = None
        self.calls = 0  # forward passes run (prefill included)

    @property
    def vocab_size(self) -> int:
        head = self.model.get_output_embeddings()
        return int(head.weight.shape[0]) if head is not None else int(self.model.config.vocab_size)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _new_cache(self, batch_size: int) -> Any:
        if hasattr(self.model, "new_cache"):  # the project's own models bring a KVCache
            return self.model.new_cache(batch_size)
        from transformers import DynamicCache

        config = self.model.config
        return DynamicCache(config=config.get_text_config() if hasattr(config, "get_text_config") else config)

    def _call_model(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                    *, prefill: bool, penultimate: bool, **model_inputs: Any
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One forward: ``(logits, top hidden or None, penultimate hidden or None)``; updates the cache."""
        self.calls += 1
        last_only = prefill and self.prefill_logits == "last"
        if last_only and self._takes_logits_to_keep:
            model_inputs.setdefault("logits_to_keep", 1)
        wanted = self.return_hidden or penultimate
        hooked = wanted and self._capture is not None  # no hooks at all on plain decoding steps
        recording = self._capture.recording(self.return_hidden, penultimate) if hooked else nullcontext({})
        with recording as grabbed:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=self.cache, use_cache=True,
                             output_hidden_states=wanted and not hooked, **model_inputs)
        if out.past_key_values is not None:
            self.cache = out.past_key_values
        logits = out.logits[:, -1:] if last_only else out.logits
        if hooked or not wanted:
            return logits, grabbed.get("top"), grabbed.get("penultimate")
        return (logits, out.hidden_states[-1] if self.return_hidden else None,
                out.hidden_states[-2] if penultimate else None)

    def _run(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor, position_ids: torch.Tensor,
             prefill: bool = False, **model_inputs: Any) -> StepOutput:
        logits, hidden, _ = self._call_model(input_ids, attention_mask, position_ids, prefill=prefill,
                                             penultimate=False, **model_inputs)
        return StepOutput(logits, hidden)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
                **model_inputs: Any) -> StepOutput:
        """Run the prompt (left or right padding allowed) and start a fresh cache.

        ``input_ids`` may be None when the prompt is given otherwise through ``model_inputs`` (e.g.
        condition embeddings of an image model); ``attention_mask [B, T]`` then gives its layout.
        """
        if input_ids is None and attention_mask is None:
            raise ValueError("prefill needs input_ids or, for embedding prompts, an attention_mask [B, T]")
        if input_ids is not None:
            attention_mask = prompt_attention_mask(input_ids, attention_mask)
        self.cache = self._new_cache(attention_mask.shape[0])
        self.slots = SlotState.from_attention_mask(attention_mask)
        return self._run(input_ids, attention_mask.long(), self.slots.prompt_positions(), prefill=True,
                         **model_inputs)

    def begin_round(self) -> None:
        self._state().begin_round()

    @property
    def round_start(self) -> int:
        return self._state().round_start

    @property
    def num_slots(self) -> int:
        return self._state().num_slots

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                attention: torch.Tensor | None = None, **model_inputs: Any) -> StepOutput:
        """Append ``tokens [B, T]`` to the cache and return their outputs.

        Args:
            valid: bool ``[B, T]``; invalid slots are padding (hidden from every query, position unused).
            offsets: tree position offsets ``[B, T]``: slot t sits at ``last chain position + 1 +
                offsets[:, t]`` (0 for the root, the depth for nodes); default continues each chain.
            model_inputs: extra keyword arguments for the model (e.g. a draft head's input features).
            attention: explicit key visibility ``[B, T, S + T]`` (S = slots before this call) for tree
                drafting/verification; default is causal over valid slots.
        """
        state = self._state()
        previous = state.num_slots
        positions, key_mask = state.append(tokens.shape[1] if valid is None else valid, offsets)
        if attention is None:
            mask: torch.Tensor = key_mask.long()
        else:
            expected = (tokens.shape[0], tokens.shape[1], previous + tokens.shape[1])
            if tuple(attention.shape) != expected:
                raise ValueError(f"attention must have shape {expected}, got {tuple(attention.shape)}")
            mask = (attention & key_mask.unsqueeze(1)).unsqueeze(1)  # [B, 1, T, S+T]
        return self._run(tokens, mask, positions, **model_inputs)

    def commit(self, keep: torch.Tensor) -> None:
        """Keep, per row, the round's slots ``keep [B, M]`` (relative to the round start, -1 = hole); trailing
        columns that are holes in every row are dropped (:func:`~mmspec.cache.drop_trailing_holes`)."""
        state = self._state()
        check_ndim(keep, 2, "keep", "[B, M]")
        rows = keep.tolist()  # one host read decides the width and whether this is a crop
        width = kept_width(rows)
        if rows_keep_prefix(rows, width):  # every row keeps its first slots in order: a crop
            self.cache = crop_cache(self.cache, state.round_start + width)
            if state.round_all_valid:
                state.keep_first(width)
                return
        else:
            self.cache = move_cache_slots(self.cache, state.round_start, keep[:, :width])
        state.commit(keep[:, :width])

    def _state(self) -> SlotState:
        if self.slots is None:
            raise RuntimeError("call prefill() before decoding")
        return self.slots


class GuidedRunner:
    """Classifier-free guidance around a runner: ``[cond; uncond]`` rows run as one doubled batch.

    The prompt comes as ``2B`` rows (the B conditional prompts, then their B unconditional versions);
    every later call takes ``B`` rows, runs them for both halves and returns the guided logits
    ``uncond + s * (cond - uncond)`` for ``B`` rows. Works for targets and for model drafters alike, so
    drafts are proposed under the same guidance.

    Args:
        runner: the wrapped runner (it sees the doubled batch).
        guidance_scale: s (1.0 is plain conditional decoding; callers usually skip the wrapper then).
        hidden: which hidden states to return: "cond" (the ``B`` conditional rows), "both" (all ``2B``
            rows, ``[cond; uncond]``: what a feature-level drafter needs to draft under guidance itself) or
            "guided" (``B`` rows ``h_u + s (h_c - h_u)``, combined like the logits: the features whose
            LM-head logits are the guided logits, for a head trained on them).
    """

    def __init__(self, runner: CausalLMRunner, guidance_scale: float, hidden: str = "cond") -> None:
        if guidance_scale < 0:
            raise ValueError(f"guidance_scale must be >= 0, got {guidance_scale}")
        if hidden not in ("cond", "both", "guided"):
            raise ValueError(f"hidden must be 'cond', 'both' or 'guided', got {hidden!r}")
        self.runner, self.guidance_scale, self.hidden = runner, guidance_scale, hidden

    @staticmethod
    def condition_drop(batch: int, device: torch.device | str) -> torch.Tensor:
        """The ``condition_drop`` mask ``[2B]`` of a guided prompt batch: False for the B conditional rows,
        True for the B unconditional ones after them, on ``device`` (the conditions' device)."""
        return torch.arange(2 * batch, device=device) >= batch

    @staticmethod
    def conditional_half(attention_mask: torch.Tensor | None, model_inputs: dict[str, Any]
                         ) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """The B conditional rows of a guided prompt batch: the first half of the ``[2B, ...]`` attention mask
        and of every tensor input with 2B rows (e.g. ``condition_drop``); other inputs pass unchanged. For
        a model that reads the same prompt unguided beside a guided target."""
        rows = attention_mask.shape[0] if attention_mask is not None else None
        if rows is None:
            rows = next((v.shape[0] for v in model_inputs.values() if isinstance(v, torch.Tensor) and v.ndim), None)
        if rows is None or rows % 2:
            raise ValueError(f"a guided prompt batch has 2B rows [cond; uncond], got {rows}")
        half = rows // 2
        inputs = {k: v[:half] if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == rows else v
                  for k, v in model_inputs.items()}
        return (attention_mask[:half] if attention_mask is not None else None), inputs

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def num_slots(self) -> int:
        return self.runner.num_slots

    @property
    def calls(self) -> int:
        return self.runner.calls

    def _merge(self, out: StepOutput) -> StepOutput:
        from mmspec.sampling import apply_guidance

        half = out.logits.shape[0] // 2
        if out.hidden is None or self.hidden == "both":
            hidden = out.hidden
        elif self.hidden == "guided":
            hidden = apply_guidance(out.hidden, self.guidance_scale)
        else:
            hidden = out.hidden[:half]
        return StepOutput(apply_guidance(out.logits, self.guidance_scale), hidden)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **model_inputs: Any) -> StepOutput:
        rows = (input_ids if input_ids is not None else attention_mask).shape[0]
        if rows % 2:
            raise ValueError(f"guided prefill expects 2B prompt rows [cond; uncond], got {rows}")
        return self._merge(self.runner.prefill(input_ids, attention_mask, **model_inputs))

    def begin_round(self) -> None:
        self.runner.begin_round()

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                attention: torch.Tensor | None = None, **model_inputs: Any) -> StepOutput:
        """``tokens`` and the slot arguments have ``B`` rows (doubled here); ``model_inputs`` are passed
        as given, so they must already have ``2B`` rows ``[cond; uncond]`` (e.g. a draft head's features)."""
        def double(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.cat([t, t], 0)

        return self._merge(self.runner.forward(double(tokens), double(valid), double(offsets), double(attention),
                                               **model_inputs))

    def commit(self, keep: torch.Tensor) -> None:
        self.runner.commit(torch.cat([keep, keep], 0))
