"""Online-logit distillation of the VLM draft heads from a frozen target (no stored corpus).

A training step::

    teacher = teacher_forward(target, input_ids, attention_mask, answer_mask=answer, **image_inputs)
    out = training_loss(draft_model, teacher, feature_noise=0.1, generator=g)
    out["loss"].backward()

:func:`teacher_forward` runs the frozen transformers VLM once over prompt + answer (no grad) and returns a
:class:`~mmspec.models.vlm_drafters.base.VLMFeatures` with everything distillation needs: logits, top hidden
states, penultimate states, the input embeddings with image features merged, image spans. :func:`training_loss`
builds the draft model's view of that run exactly as the drafter does at inference
(:func:`~mmspec.models.vlm_drafters.base.assemble_units`, with the training-time behaviour of the visual module:
SpecVLM's Gumbel-softmax gate, fresh random pruning), runs the head teacher-forced on EAGLE pairs and
returns::

    loss = feature_weight * SmoothL1(predicted features, teacher top features)      (1.0)
         + ce_weight * CE(softmax(teacher logits), log_softmax(draft logits))       (0.1)
         [+ the same for each self-rollout pass]  [+ budget_weight * SpecVLM budget]

Per method: FLASH predicts K future features per pair and every one is distilled (feature of the k-th
next token, teacher logits there); ViSpec adds ``rollout_steps = 1`` self-rollout passes by default (the
head's own predicted features, detached, replace the target's as inputs; the anti-shortcut pass); SpecVLM's
gate is trained through its straight-through Gumbel-softmax weights, optionally with a budget term (the
expected fraction of image tokens kept).

Targets are the features of text tokens only (never image placeholders), restricted to answer tokens when
``answer_mask`` is given. "Features" are the target's top hidden states (final-norm, what the LM head
reads): the EAGLE line's "second-to-top layer" (the penultimate layer when the LM head is counted as the top
one), which is the only feature a draft can hand to the frozen LM head.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mmspec.models.vlm_drafters.base import VLMDraftHead, VLMFeatures, assemble_units
from mmspec.models.vlm_targets import VLMRunner


@torch.no_grad()
def teacher_forward(target: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    answer_mask: torch.Tensor | None = None, **model_inputs: Any) -> VLMFeatures:
    """Run the frozen target VLM over full sequences (prompt + answer) for distillation.

    Args:
        target: a transformers VLM supported by :class:`~mmspec.models.vlm_targets.VLMRunner` (LLaVA,
            LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL), in eval mode. Freeze it (``requires_grad_(False)``): its
            embedding and LM head are used by the draft head and would otherwise collect gradients.
        input_ids / attention_mask: ``[B, T]`` prompt + answer (any padding; the image placeholders expanded
            as the model's processor does).
        answer_mask: bool ``[B, T]`` True at answer tokens (losses cover their features; SpecVLM's gate pools
            over the rest). None: every token is both prompt and target.
        model_inputs: the image inputs (``pixel_values``; ``image_sizes``; ``image_grid_thw``,
            ``mm_token_type_ids``...), as for :meth:`VLMRunner.prefill`.
    Returns:
        :class:`~mmspec.models.vlm_drafters.base.VLMFeatures` (logits ``[B, T, V]``, hidden / penultimate /
        inputs_embeds ``[B, T, D]``, image spans) without gradients.
    """
    if answer_mask is not None and tuple(answer_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"answer_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                         f"got {tuple(answer_mask.shape)}")
    runner = VLMRunner(target, return_hidden=True, return_penultimate=True, prefill_logits="all")
    out = runner.prefill(input_ids, attention_mask, **model_inputs)
    runner.cache = None  # the cache is not needed for training
    return VLMFeatures.from_target_output(input_ids, attention_mask, out, who="teacher_forward",
                                          answer_mask=answer_mask)


def training_loss(model: VLMDraftHead, teacher: VLMFeatures, *, feature_weight: float = 1.0, ce_weight: float = 0.1,
                  feature_noise: float = 0.0, rollout_steps: int | None = None, budget_weight: float = 0.0,
                  generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Distillation loss of any VLM draft head (EagleVLM, FLASH, ViSpec, SpecVLM) on one teacher batch.

    Args:
        model: the draft model, bound to the target (``model.bind_target(target)``), in train mode.
        teacher: :func:`teacher_forward`'s output.
        feature_weight / ce_weight: weights of the SmoothL1 feature term (1.0) and the soft cross-entropy
            against the teacher's logits (0.1).
        feature_noise: width of uniform noise added to the input features (EAGLE's robustness trick).
        rollout_steps: self-rollout passes (None: the method's default, 1 for ViSpec, 0 otherwise).
        budget_weight: weight of SpecVLM's budget term (expected fraction of image tokens kept).
        generator: random source of noise, SpecVLM's Gumbel samples and random pruning.
    Returns:
        dict with ``loss`` (differentiable), and detached ``feature_loss``, ``ce_loss`` (teacher-forced pass),
        ``top1`` (argmax agreement of the next-token prediction with the teacher: an acceptance proxy),
        ``top1_future [K]`` (per future step; FLASH), ``rollout_loss`` (sum over rollout passes), and the
        method's auxiliary terms (its ``auxiliary_loss`` hook; SpecVLM: ``budget``).
    """
    model._bound()
    model.check_features(teacher)
    if teacher.logits is None:
        raise ValueError("training_loss needs the teacher's logits (use teacher_forward)")
    steps = model.default_rollout_steps if rollout_steps is None else rollout_steps
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"rollout_steps must be an int >= 0, got {rollout_steps!r}")
    view = model.visual_view(teacher, stochastic=True, generator=generator)
    sequence = assemble_units(teacher, view, model.head.fc.weight.dtype)
    pairs = sequence.training_pairs()
    targets = _targets(sequence, teacher, pairs["valid"], model.num_future)
    inputs = pairs["target_hidden"]
    if feature_noise > 0:
        noise = torch.rand(inputs.shape, generator=generator, dtype=inputs.dtype, device="cpu").to(inputs.device)
        inputs = inputs + (noise - 0.5) * feature_noise * pairs["valid"].unsqueeze(-1).to(inputs.dtype)

    def run(features: torch.Tensor) -> torch.Tensor:  # [B, P, K, d]
        predicted, _ = model.predict_features(
            pairs["tokens"], features, pairs["token_embeds"], attention_mask=pairs["valid"].long(),
            position_ids=pairs["positions"], global_feature=view.global_feature,
            fuse_global=pairs["fuse_global"] if view.global_feature is not None else None)
        return predicted if predicted.ndim == 4 else predicted.unsqueeze(2)

    predicted = run(inputs)
    terms = _distill(model, predicted, targets)
    loss = feature_weight * terms["feature_loss"] + ce_weight * terms["ce_loss"]
    rollout = predicted.new_zeros(())
    replace = pairs["valid"][:, :-1] & pairs["valid"][:, 1:] & ~sequence.visual[:, 1:-1]  # inputs of pairs 1..P-1
    for _ in range(steps):  # feed the head its own next-feature predictions (detached), same targets
        own = torch.cat([inputs[:, :1], torch.where(replace.unsqueeze(-1), predicted[:, :-1, 0].detach(),
                                                    inputs[:, 1:])], 1)
        predicted = run(own)
        rolled = _distill(model, predicted, targets)
        rollout = rollout + feature_weight * rolled["feature_loss"] + ce_weight * rolled["ce_loss"]
    out = {"loss": loss + rollout, "feature_loss": terms["feature_loss"].detach(), "ce_loss": terms["ce_loss"].detach(),
           "top1": terms["top1"][0], "top1_future": terms["top1"], "rollout_loss": rollout.detach()}
    for name, value in model.auxiliary_loss(view, teacher).items():
        if name == "budget":
            out["loss"] = out["loss"] + budget_weight * value
        out[name] = value.detach()
    return out


def _targets(sequence, teacher: VLMFeatures, pair_valid: torch.Tensor, num_future: int) -> dict[str, torch.Tensor]:
    """Which (row, pair, future step) have a target: the unit ``k + 1 + j`` must be a text unit (an answer
    token when the teacher has an answer mask). Returns the selected indices, target features and the
    teacher's logits there."""
    batch, pairs = pair_valid.shape
    length = sequence.tokens.shape[1]
    k = torch.arange(pairs, device=pair_valid.device).view(1, -1, 1)
    j = torch.arange(num_future, device=pair_valid.device).view(1, 1, -1)
    unit = (k + 1 + j).expand(batch, -1, -1)  # [B, P, K]
    inside = unit < length
    unit = unit.clamp(max=length - 1)
    rows = torch.arange(batch, device=pair_valid.device).view(-1, 1, 1).expand_as(unit)
    source = sequence.source[rows, unit]
    ok = inside & pair_valid.unsqueeze(-1) & sequence.valid[rows, unit] & ~sequence.visual[rows, unit]
    if teacher.answer_mask is not None:
        ok &= teacher.answer_mask[rows, source.clamp_min(0)]
    b, p, f = ok.nonzero(as_tuple=True)
    if b.numel() == 0:
        raise ValueError("the teacher batch has no text target (answer_mask selects no token after a valid pair)")
    slot = source[b, p, f]
    return {"index": (b, p, f), "features": teacher.hidden[b, slot], "logits": teacher.logits[b, slot]}


def _distill(model: VLMDraftHead, predicted: torch.Tensor, targets: dict[str, Any]) -> dict[str, torch.Tensor]:
    """SmoothL1 to the teacher features, soft CE to the teacher logits, top-1 agreement per future step."""
    b, p, f = targets["index"]
    chosen = predicted[b, p, f]  # [N, d]
    feature_loss = F.smooth_l1_loss(chosen, targets["features"].to(chosen.dtype))
    log_q = model.logits(chosen).float().log_softmax(-1)
    teacher_logits = targets["logits"].float()
    ce_loss = -(teacher_logits.softmax(-1) * log_q).sum(-1).mean()
    agree = (log_q.argmax(-1) == teacher_logits.argmax(-1)).float()
    top1 = torch.stack([agree[f == step].mean() if (f == step).any() else agree.new_tensor(float("nan"))
                        for step in range(predicted.shape[2])])
    return {"feature_loss": feature_loss, "ce_loss": ce_loss, "top1": top1.detach()}
