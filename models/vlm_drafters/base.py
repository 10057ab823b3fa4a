"""What EagleVLM, FLASH, ViSpec and SpecVLM share: an EAGLE-style head plus a *view* of the prompt's images.

All four draft heads are the EAGLE head of :mod:`mmspec.models.eagle` (``fc([embed(x) ; h])``, one decoder
layer, the target's frozen embedding and LM head) that reads the prompt differently at its image spans:

* the target's prefill gives, per prompt slot, a token id, the target's top hidden state ``h`` (final-norm
  features, what the LM head reads) and the input embedding the language model read (image features
  merged in);
* a method's *visual module* turns every image span into M draft-side **units** (an input-embedding
  vector, a feature vector and a position): all N image tokens (EagleVLM), C latent vectors (FLASH),
  ``num_q - 1`` adaptor tokens (ViSpec), or whatever the gated compressor chose (SpecVLM);
* text slots stay units of their own: (token id, ``h``, the target's text position);
* the head then reads EAGLE pairs over the unit sequence: pair k = (embedding of unit k+1, feature of unit
  k) at unit k's position, and the last pair is (pending token, feature of the last unit).

:func:`assemble_units` builds that sequence once for inference (:class:`VLMHeadDrafter`) and for training
(:func:`mmspec.models.recipes.vlm_drafter_loss.training_loss`), so both read the same layout. Text keeps the
target's own 1-D text positions (valid tokens counted from 0); units of a compressed span carry the
positions their method gives them, so the draft sequence may have position gaps. :class:`HeadRunner` is
the head's :class:`~mmspec.runner.CausalLMRunner` with a per-row position offset, which keeps every later
draft slot at the target's text position (chains and trees).

Correctness never depends on the head: the core verifies every draft against the target.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from mmspec.cache import SlotState
from mmspec.drafters import TreeConfig
from mmspec.runner import CausalLMRunner, StepOutput
from mmspec.sampling import SamplingConfig
from mmspec.speculate import PrefillContext

from ..eagle import EagleDrafter, EagleHead, EagleOutput


# ----------------------------------------------------------------------------------------------------------
# What a head reads of one target run
# ----------------------------------------------------------------------------------------------------------
@dataclass
class VLMFeatures:
    """One target run over a padded batch, as the draft heads read it (a prompt at inference, prompt +
    answer in training).

    Attributes:
        input_ids: LongTensor ``[B, T]`` (image placeholder tokens included).
        attention_mask: bool ``[B, T]`` (padding False).
        hidden: ``[B, T, D]`` the target's top hidden states (final-norm features the LM head reads).
        inputs_embeds: ``[B, T, D]`` what the language model read (image features merged in).
        image_spans: per row, the ``(start, end)`` slot ranges of its images (end exclusive, prompt order).
        logits: ``[B, T, V]`` the target's logits (the distillation targets), or None.
        penultimate: ``[B, T, D]`` output of the second-to-last decoder layer (SpecVLM's gate), or None.
        answer_mask: bool ``[B, T]`` True at answer tokens (training: losses cover the features of these
            tokens; the SpecVLM gate pools over the others), or None (every token is both).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    hidden: torch.Tensor
    inputs_embeds: torch.Tensor
    image_spans: list[list[tuple[int, int]]]
    logits: torch.Tensor | None = None
    penultimate: torch.Tensor | None = None
    answer_mask: torch.Tensor | None = None

    positions: torch.Tensor = field(init=False, repr=False)  # [B, T] 1-D text positions (valid tokens from 0)

    def __post_init__(self) -> None:
        # the core's per-row text positions: valid tokens counted from 0 (left padding excluded)
        self.positions = (self.attention_mask.long().cumsum(-1) - 1).clamp_min(0)

    @property
    def prompt_mask(self) -> torch.Tensor:
        """bool ``[B, T]``: valid slots that are not answer tokens."""
        if self.answer_mask is None:
            return self.attention_mask
        return self.attention_mask & ~self.answer_mask

    @classmethod
    def from_target_output(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, out: Any,
                           who: str = "this drafter", answer_mask: torch.Tensor | None = None) -> VLMFeatures:
        """From a :class:`~mmspec.models.vlm_targets.VLMPrefillOutput`; clear errors for anything else."""
        if getattr(out, "image_spans", None) is None or getattr(out, "inputs_embeds", None) is None:
            raise ValueError(f"{who} needs a VLM target: run the target with mmspec.models.VLMRunner(model, "
                             f"return_hidden=True) (got a {type(out).__name__} without image spans / input embeddings)")
        if out.hidden is None:
            raise ValueError(f"{who} needs the target's hidden states: use VLMRunner(model, return_hidden=True)")
        if input_ids is None:
            raise ValueError(f"{who} needs the prompt's input_ids [B, T]")
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        return cls(input_ids, mask, out.hidden, out.inputs_embeds, out.image_spans, out.logits,
                   getattr(out, "penultimate", None), None if answer_mask is None else answer_mask.bool() & mask)


# ----------------------------------------------------------------------------------------------------------
# The draft-side view of the image spans
# ----------------------------------------------------------------------------------------------------------
@dataclass
class SpanUnits:
    """The M draft units one image span becomes: ``embeds [M, d]`` (input-embedding part), ``features
    [M, d]`` (feature part) and ``positions [M]``. M may be 0 (the span is dropped)."""

    embeds: torch.Tensor
    features: torch.Tensor
    positions: torch.Tensor

    @property
    def size(self) -> int:
        return self.features.shape[0]


@dataclass
class VisualView:
    """A method's view of every image span of a batch.

    Attributes:
        spans: per row, one :class:`SpanUnits` per image span (same order as ``VLMFeatures.image_spans``).
        global_feature: ``[B, d]`` a per-row vector fused into later text features (ViSpec's g), or None.
        has_global: bool ``[B]`` rows that have a global vector (rows with images).
        info: method details (SpecVLM: ``primitive`` per row, ``gate_probs [B, P]``, ``gate_weights [B, P]``).
    """

    spans: list[list[SpanUnits]]
    global_feature: torch.Tensor | None = None
    has_global: torch.Tensor | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_visual_tokens(self) -> torch.Tensor:
        """LongTensor ``[B]``: visual units the draft head attends to, per row."""
        return torch.tensor([sum(u.size for u in row) for row in self.spans], dtype=torch.long)


def identity_units(features: VLMFeatures, row: int, span: tuple[int, int], dtype: torch.dtype) -> SpanUnits:
    """Every image token of ``span`` as a unit: the embedding the target read, its feature, its position."""
    start, end = span
    return SpanUnits(features.inputs_embeds[row, start:end].to(dtype), features.hidden[row, start:end].to(dtype),
                     features.positions[row, start:end])


def last_positions(features: VLMFeatures, row: int, span: tuple[int, int], count: int) -> torch.Tensor:
    """Positions of the last ``count`` tokens of ``span`` (``count <= span length``)."""
    return features.positions[row, span[1] - count: span[1]]


def pack_spans(values: torch.Tensor, spans: list[list[tuple[int, int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the image spans of ``values [B, T, d]`` into ``[S, N_max, d]`` (S spans of the batch in row
    order, zero-padded) and the bool ``[S, N_max]`` mask of real tokens."""
    pieces = [values[b, s:e] for b, row in enumerate(spans) for s, e in row]
    if not pieces:
        return values.new_zeros(0, 0, values.shape[-1]), torch.zeros(0, 0, dtype=torch.bool, device=values.device)
    packed = nn.utils.rnn.pad_sequence(pieces, batch_first=True)
    lengths = torch.tensor([p.shape[0] for p in pieces], device=values.device)
    return packed, torch.arange(packed.shape[1], device=values.device) < lengths.unsqueeze(1)


# ----------------------------------------------------------------------------------------------------------
# The unit sequence
# ----------------------------------------------------------------------------------------------------------
@dataclass
class DraftSequence:
    """Units of every row, left-padded to one length L.

    Attributes:
        tokens: LongTensor ``[B, L]`` token id of text units, -1 at visual units and padding.
        embeds: ``[B, L, d]`` input embeddings of visual units (zeros at text units: the head embeds their ids).
        features: ``[B, L, d]`` the feature part of every unit.
        positions: LongTensor ``[B, L]``.
        valid / visual: bool ``[B, L]``.
        source: LongTensor ``[B, L]`` the target slot of a text unit (-1 for visual units and padding).
        fuse_global: bool ``[B, L]`` text units after the row's first image (ViSpec fuses g into them).
    """

    tokens: torch.Tensor
    embeds: torch.Tensor
    features: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    visual: torch.Tensor
    source: torch.Tensor
    fuse_global: torch.Tensor

    def inference_pairs(self, pending: torch.Tensor) -> dict[str, torch.Tensor]:
        """EAGLE pairs of the prompt: pair k = (unit k+1, feature of unit k), the last = (pending ``[B]``,
        feature of the last unit). Every row's last slot is valid (left padding)."""
        return dict(tokens=torch.cat([self.tokens[:, 1:], pending.unsqueeze(1)], 1),
                    token_embeds=torch.cat([self.embeds[:, 1:], torch.zeros_like(self.embeds[:, :1])], 1),
                    target_hidden=self.features, positions=self.positions, valid=self.valid,
                    fuse_global=self.fuse_global)

    def training_pairs(self) -> dict[str, torch.Tensor]:
        """Teacher-forced pairs over a full sequence: pair k = (unit k+1, feature of unit k), k < L - 1."""
        return dict(tokens=self.tokens[:, 1:], token_embeds=self.embeds[:, 1:], target_hidden=self.features[:, :-1],
                    positions=self.positions[:, :-1], valid=self.valid[:, :-1] & self.valid[:, 1:],
                    fuse_global=self.fuse_global[:, :-1])


def assemble_units(features: VLMFeatures, view: VisualView, dtype: torch.dtype) -> DraftSequence:
    """Text units (valid slots outside the image spans) and the view's visual units, in prompt order,
    left-padded. Gradients flow into the visual units (training)."""
    batch = features.input_ids.shape[0]
    valid = features.attention_mask.bool()
    positions = features.positions
    device = features.input_ids.device
    rows = []
    for b in range(batch):
        spans = features.image_spans[b]
        if len(view.spans[b]) != len(spans):
            raise ValueError(f"row {b}: the visual view has {len(view.spans[b])} spans, the prompt {len(spans)}")
        parts: list[tuple] = []
        cursor = 0
        for index, ((start, end), units) in enumerate(zip(spans, view.spans[b])):
            parts.append(_text_part(features, b, cursor, start, valid, positions, dtype, after_image=index > 0))
            n = units.size
            parts.append((torch.full((n,), -1, dtype=torch.long, device=device), units.embeds.to(dtype),
                          units.features.to(dtype), units.positions.to(device),
                          torch.ones(n, dtype=torch.bool, device=device), torch.full((n,), -1, device=device),
                          torch.zeros(n, dtype=torch.bool, device=device)))
            cursor = end
        parts.append(_text_part(features, b, cursor, valid.shape[1], valid, positions, dtype, after_image=bool(spans)))
        rows.append([torch.cat(column, 0) for column in zip(*parts)])
    length = max(row[0].shape[0] for row in rows)
    if length == 0:
        raise ValueError("the prompt has no valid token")

    def left_pad(column: int, value: float | bool) -> torch.Tensor:
        padded = []
        for row in rows:
            x = row[column]
            pad = (0, 0) * (x.ndim - 1) + (length - x.shape[0], 0)
            padded.append(F.pad(x, pad, value=value))
        return torch.stack(padded)

    lengths = torch.tensor([row[0].shape[0] for row in rows], device=device)
    valid_units = torch.arange(length, device=device) >= (length - lengths).unsqueeze(1)
    return DraftSequence(tokens=left_pad(0, -1), embeds=left_pad(1, 0.0), features=left_pad(2, 0.0),
                         positions=left_pad(3, 0), valid=valid_units, visual=left_pad(4, False),
                         source=left_pad(5, -1), fuse_global=left_pad(6, False))


def _text_part(features: VLMFeatures, row: int, start: int, end: int, valid: torch.Tensor, positions: torch.Tensor,
               dtype: torch.dtype, after_image: bool) -> tuple:
    slots = start + valid[row, start:end].nonzero().flatten()
    n = slots.shape[0]
    width = features.hidden.shape[-1]
    return (features.input_ids[row, slots], features.hidden.new_zeros(n, width, dtype=dtype),
            features.hidden[row, slots].to(dtype), positions[row, slots],
            torch.zeros(n, dtype=torch.bool, device=slots.device), slots,
            torch.full((n,), after_image, dtype=torch.bool, device=slots.device))


# ----------------------------------------------------------------------------------------------------------
# The model: EAGLE head + visual module
# ----------------------------------------------------------------------------------------------------------
def check_positive(value: Any, name: str) -> None:
    """ValueError naming ``name`` unless ``value`` is a positive int."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class VLMDraftHead(ModelMixin, ConfigMixin):
    """Base of :class:`EagleVLMHead`, :class:`FlashHead`, :class:`ViSpecHead` and :class:`SpecVLMHead`.

    Holds ``self.head`` (an :class:`~mmspec.models.eagle.EagleHead`); subclasses add their visual module and
    implement :meth:`visual_view` (and optionally :meth:`condition_features` / :meth:`readout`). Saved with
    ``save_pretrained`` (safetensors, without the target's embedding and LM head) and bound to a target with
    :meth:`bind_target`.
    """

    #: features predicted per pair (FLASH: K future features; 1 for EAGLE-style heads)
    num_future: int = 1
    #: self-rollout passes of the training loss (ViSpec: 1)
    default_rollout_steps: int = 0

    def _init_head(self, hidden_size: int, vocab_size: int, num_attention_heads: int,
                   num_key_value_heads: int | None, intermediate_size: int | None, rope_theta: float,
                   input_norm: bool, norm_eps: float, max_position_embeddings: int) -> None:
        for value, name in ((hidden_size, "hidden_size"), (vocab_size, "vocab_size"),
                            (num_attention_heads, "num_attention_heads")):
            check_positive(value, name)
        if hidden_size % num_attention_heads:
            raise ValueError(f"hidden_size {hidden_size} must be divisible by num_attention_heads {num_attention_heads}")
        self.head = EagleHead(hidden_size=hidden_size, vocab_size=vocab_size, num_attention_heads=num_attention_heads,
                              num_key_value_heads=num_key_value_heads, intermediate_size=intermediate_size,
                              rope_theta=rope_theta, input_norm=input_norm, norm_eps=norm_eps,
                              max_position_embeddings=max_position_embeddings)

    # -- target binding -------------------------------------------------------------------------------------
    def bind_target(self, target: Any) -> VLMDraftHead:
        """Use the target VLM's frozen token embedding and LM head (not parameters of this model).

        Args:
            target: the transformers VLM (``LlavaForConditionalGeneration``, ``Qwen2VLForConditionalGeneration``,
                ...) or a :class:`~mmspec.models.vlm_targets.VLMRunner` around it.
        Raises:
            ValueError: the target's language model has another hidden size or vocabulary (a drafter trained
                for another target).
        """
        model = target.model if isinstance(target, CausalLMRunner) else target
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise ValueError(f"bind_target needs a transformers VLM with an LM head, got {type(model).__name__}")
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        name = type(self).__name__
        vocab, width = head.weight.shape
        if width != self.config.hidden_size:
            raise ValueError(f"drafter trained for another target: this {name} has hidden size "
                             f"{self.config.hidden_size}, the target's language model has {width}")
        if vocab != self.config.vocab_size:
            raise ValueError(f"drafter trained for another target: this {name} has a vocabulary of "
                             f"{self.config.vocab_size} tokens, the target's LM head has {vocab}")
        self.head.bind_target(embed, head)
        return self

    @property
    def is_bound(self) -> bool:
        return bool(self.head._target)

    def _bound(self) -> dict[str, nn.Module]:
        if not self.is_bound:
            raise ValueError(f"this {type(self).__name__} is not bound to a target: call model.bind_target(vlm) first")
        return self.head._bound()

    def get_output_embeddings(self) -> nn.Module:
        return self._bound()["head"]

    def new_cache(self, batch_size: int) -> Any:
        return self.head.new_cache(batch_size)

    def check_features(self, features: VLMFeatures) -> None:
        """Raise a clear ValueError if ``features`` come from a target this model was not built for."""
        name = type(self).__name__
        if features.hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(f"drafter trained for another target: the target's features have width "
                             f"{features.hidden.shape[-1]}, this {name} expects {self.config.hidden_size}")
        if features.logits is not None and features.logits.shape[-1] != self.config.vocab_size:
            raise ValueError(f"drafter trained for another target: the target has {features.logits.shape[-1]} "
                             f"tokens, this {name} {self.config.vocab_size}")

    # -- method hooks ---------------------------------------------------------------------------------------
    def visual_view(self, features: VLMFeatures, stochastic: bool = False,
                    generator: torch.Generator | None = None) -> VisualView:
        """The draft-side units of every image span. ``stochastic``: training-time behaviour (SpecVLM's
        Gumbel-softmax gate and random pruning); inference passes False."""
        raise NotImplementedError(f"{type(self).__name__} must implement visual_view")

    def condition_features(self, hidden: torch.Tensor, global_feature: torch.Tensor | None,
                           fuse_global: torch.Tensor | None) -> torch.Tensor:
        """Transform the input features before the fc (ViSpec fuses its global vector here)."""
        return hidden

    def readout(self, features: torch.Tensor) -> torch.Tensor:
        """Decoder output ``[B, T, d]`` -> predicted features (``[B, T, d]``; FLASH ``[B, T, K, d]``)."""
        return features

    def auxiliary_loss(self, view: VisualView, features: VLMFeatures) -> dict[str, torch.Tensor]:
        """Method-specific training terms (SpecVLM's budget term): the training loss
        (:func:`mmspec.models.recipes.vlm_drafter_loss.training_loss`) calls this hook and adds its terms."""
        return {}

    # -- forward --------------------------------------------------------------------------------------------
    def predict_features(self, input_ids: torch.Tensor | None, target_hidden: torch.Tensor,
                         token_embeds: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                         position_ids: torch.Tensor | None = None, past_key_values: Any = None, use_cache: bool = False,
                         global_feature: torch.Tensor | None = None, fuse_global: torch.Tensor | None = None,
                         ) -> tuple[torch.Tensor, Any]:
        """Predicted features (see :meth:`readout`) of pairs ``(input_ids [B, T] (-1: use token_embeds),
        target_hidden [B, T, d])`` and the head's cache."""
        dtype = self.head.fc.weight.dtype
        hidden = self.condition_features(target_hidden.to(dtype),
                                         None if global_feature is None else global_feature.to(dtype), fuse_global)
        fused = self.head.fuse(input_ids, hidden, None if token_embeds is None else token_embeds.to(dtype))
        out = self.head.decoder(inputs_embeds=fused, attention_mask=attention_mask, position_ids=position_ids,
                                past_key_values=past_key_values, use_cache=use_cache)
        return self.readout(out.last_hidden_state), out.past_key_values

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's frozen LM head over predicted features."""
        head = self.get_output_embeddings()
        return head(features.to(head.weight.dtype))

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: Any = None, use_cache: bool = True,
                output_hidden_states: bool = False, target_hidden: torch.Tensor | None = None,
                token_embeds: torch.Tensor | None = None, global_feature: torch.Tensor | None = None,
                fuse_global: torch.Tensor | None = None, logits_to_keep: int = 0) -> EagleOutput:
        """Runner interface: predicted features and their logits (``[B, T, V]``; FLASH ``[B, T, K, V]``);
        ``logits_to_keep`` as in :meth:`~mmspec.models.eagle.EagleHead.forward` (both of the last slots only,
        0 = all)."""
        if target_hidden is None:
            raise ValueError(f"{type(self).__name__} needs target_hidden [B, T, d], the feature preceding each token")
        features, cache = self.predict_features(input_ids, target_hidden, token_embeds, attention_mask, position_ids,
                                                past_key_values, use_cache, global_feature, fuse_global)
        kept = features[:, -logits_to_keep:] if logits_to_keep else features
        return EagleOutput(self.logits(kept), cache, (kept,))


# ----------------------------------------------------------------------------------------------------------
# Inference
# ----------------------------------------------------------------------------------------------------------
class HeadRunner(CausalLMRunner):
    """The head's runner: slots carry the positions of their units, and every later slot is shifted by a
    per-row offset so that it sits at the target's text position (chains and trees alike).

    ``step_inputs`` are extra model inputs passed to every call after the prefill (ViSpec's global vector).
    """

    def __init__(self, model: VLMDraftHead) -> None:
        super().__init__(model, return_hidden=True)
        self.position_offset: torch.Tensor | None = None
        self.step_inputs: dict[str, torch.Tensor] = {}

    def prefill_pairs(self, tokens: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor,
                      **model_inputs: Any) -> StepOutput:
        """Run the prompt's pairs ``[B, L]`` (left-padded: every row's last slot is valid) at ``positions``."""
        self.cache = self._new_cache(tokens.shape[0])
        self.slots = SlotState.from_attention_mask(valid)
        self.position_offset = positions[:, -1] - self.slots.last_position
        self.step_inputs = {}
        return CausalLMRunner._run(self, tokens, valid.long(), positions, **model_inputs)

    def _run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
             **model_inputs: Any) -> StepOutput:
        if self.position_offset is None:
            raise RuntimeError("HeadRunner: call prefill_pairs() first")
        position_ids = position_ids + self.position_offset.to(position_ids.device).unsqueeze(-1)
        return super()._run(input_ids, attention_mask, position_ids, **self.step_inputs, **model_inputs)


class VLMHeadDrafter(EagleDrafter):
    """Drafts with any :class:`VLMDraftHead` on a :class:`~mmspec.models.vlm_targets.VLMRunner` target:
    chains, or EAGLE-2 dynamic trees (``tree=TreeConfig(...)``).

    The prefill turns the target's prompt outputs into the head's view (:meth:`VLMDraftHead.visual_view`,
    inference mode) and feeds the pairs; every later round is :class:`~mmspec.models.eagle.EagleDrafter`'s
    (committed tokens re-fed with the target's true features, drafts from the head's own features).

    Args:
        model: a bound head (``model.bind_target(vlm)``); untrained heads are lossless too.
        num_draft_tokens: chain length K (ignored when ``tree`` is given).
        sampling: the target's sampling config (greedy, or sampled drafts with their distributions).
        tree: an EAGLE-2 :class:`~mmspec.drafters.TreeConfig` (deterministic top-k expansion) or None.
        generator: random source of sampled drafts.
        confidence_threshold: dynamic chain length (:func:`~mmspec.drafters.draft_chain`): a chain stops
            before K once every row's last draft had less than this probability under the head; 0
            drafts K. Lossless like any chain length; not with ``tree``.

    Attributes (after each prefill):
        draft_visual_tokens: LongTensor ``[B]`` visual units the head attends to per row.
        target_visual_tokens: LongTensor ``[B]`` image tokens of each prompt (what the target attends to).
        view_info: the view's method details (SpecVLM: ``view_info["primitive"]``, one name per row).
    """

    model_class: type[VLMDraftHead] = VLMDraftHead
    needs_target_hidden = True

    def __init__(self, model: VLMDraftHead, num_draft_tokens: int = 4,
                 sampling: SamplingConfig = SamplingConfig(do_sample=False), tree: TreeConfig | None = None,
                 generator: torch.Generator | None = None, confidence_threshold: float = 0.0) -> None:
        if not isinstance(model, self.model_class):
            raise ValueError(f"{type(self).__name__} needs a {self.model_class.__name__}, got {type(model).__name__}")
        if tree is not None and not isinstance(tree, TreeConfig):
            raise ValueError(f"tree must be a TreeConfig or None, got {type(tree).__name__}")
        model._bound()  # clear error for an unbound model
        super().__init__(model.head, num_draft_tokens, sampling, tree, generator,
                         confidence_threshold=confidence_threshold)
        self.num_future = model.num_future  # tokens per forward: the model's readout, not its inner EAGLE layer's
        self.model = model
        self.runner = HeadRunner(model)
        self.draft_visual_tokens: torch.Tensor | None = None
        self.target_visual_tokens: torch.Tensor | None = None
        self.view_info: dict[str, Any] = {}

    def prefill(self, context: PrefillContext) -> None:
        features = VLMFeatures.from_target_output(context.input_ids, context.attention_mask, context.target,
                                                  who=type(self).__name__)
        self.model.check_features(features)  # width and vocabulary of the target actually run
        view = self.visual_view(features)
        sequence = assemble_units(features, view, self.model.head.fc.weight.dtype)
        pairs = sequence.inference_pairs(context.first_tokens)
        extra: dict[str, torch.Tensor] = {}
        if view.global_feature is not None:
            extra = {"global_feature": view.global_feature, "fuse_global": pairs["fuse_global"]}
        out = self.runner.prefill_pairs(pairs["tokens"], pairs["valid"], pairs["positions"],
                                        target_hidden=pairs["target_hidden"], token_embeds=pairs["token_embeds"],
                                        **extra)
        if view.global_feature is not None:  # every later slot is text after the image (rows with images)
            self.runner.step_inputs = {"global_feature": view.global_feature,
                                       "fuse_global": view.has_global.unsqueeze(1)}
        self._root = (out.logits[:, -1], out.hidden[:, -1])
        self._pending_pairs = None
        self.draft_visual_tokens = view.num_visual_tokens
        self.target_visual_tokens = torch.tensor([sum(e - s for s, e in row) for row in features.image_spans])
        self.view_info = view.info

    def visual_view(self, features: VLMFeatures) -> VisualView:
        """The model's inference-time view of the prompt's images."""
        return self.model.visual_view(features, stochastic=False)
