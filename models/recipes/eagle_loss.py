"""EAGLE's training objective for :class:`~mmspec.models.eagle.EagleHead` (teacher forcing on target features).

:func:`eagle_loss` trains the head's next-feature prediction (SmoothL1) and its token distribution (soft
cross-entropy against the target's), optionally at drafting depths beyond 1 (EAGLE-3's training-time test,
computed in parallel by :func:`rollout_features`) and, for a head with ``num_future`` K > 1, on every future.
The model file holds the network and its drafter; this module holds what only training needs.
"""

from __future__ import annotations

import torch
from torch import nn

from mmspec.models.eagle import EagleHead
from mmspec.validation import check_positive_int


def eagle_loss(head: EagleHead, input_ids: torch.Tensor | None, target_hidden: torch.Tensor,
               valid: torch.Tensor | None = None, feature_noise: float = 0.0, feature_weight: float = 1.0,
               ce_weight: float = 0.1, generator: torch.Generator | None = None,
               rollout_steps: int = 1, train_first_future: bool = True) -> dict[str, torch.Tensor]:
    """EAGLE's training objective on one batch of target features (teacher forcing).

    Pairs (x_i, h_{i-1}) predict h_i: SmoothL1 to the target feature (``feature_weight``) plus a soft
    cross-entropy of the head's token distribution against the target's (``ce_weight``); the input
    features get uniform noise of width ``feature_noise`` (robustness to the head's own errors).

    ``rollout_steps = n > 1`` adds EAGLE-3's *training-time test*: the head is also trained at drafting
    depths 2..n, where (as in a drafting chain) its input feature is its own prediction one slot back and
    it attends to the true pairs up to the chain's root plus its own earlier predictions in the chain
    (:func:`rollout_features`; the same numbers the drafter computes step by step, tested). Teacher
    forcing alone trains only depth 1, so the head never learns to continue from its own (imperfect)
    features, and acceptance falls with depth. Tokens stay teacher-forced (a chain only continues
    while its tokens are the target's). The loss is the mean over depths; depth d >= 2 counts the slots
    whose whole chain (root .. slot) carries image tokens.

    Args:
        input_ids: ``[B, T]`` tokens (-1 or None where there is no token id, e.g. a condition prefix).
        target_hidden: ``[B, T, d]`` target top hidden states of the same positions (no grad).
        valid: bool ``[B, T]`` (padding False).
        rollout_steps: drafting depths trained (1: plain EAGLE teacher forcing).
        train_first_future: a head with ``num_future`` K > 1: False leaves future 1 out of the loss (it is
            still reported), for a readout trained on a frozen plain head whose next-feature prediction
            must stay its own (the readout's first offset then keeps its zero start).
    Returns:
        dict with "loss" (mean over depths), "feature_loss", "ce_loss" and "top1" of depth 1 over every
        valid slot (top1: agreement of argmaxes, a proxy for acceptance) and, when ``rollout_steps > 1``,
        "top1_depth{d}" for d = 1..n over the slots that can be step d of a drafting chain (token slots
        only: the acceptance-relevant agreement; depth 1's "top1" also counts condition slots).
    """
    check_positive_int(rollout_steps, "rollout_steps")
    batch, length, _ = target_hidden.shape
    if length < 2:
        raise ValueError("eagle_loss needs sequences of at least two positions")
    valid = torch.ones(batch, length, dtype=torch.bool, device=target_hidden.device) if valid is None else valid.bool()
    tokens = None if input_ids is None else input_ids[:, 1:]
    inputs = target_hidden[:, :-1]
    if feature_noise > 0:
        noise = torch.rand(inputs.shape, generator=generator, dtype=inputs.dtype, device="cpu").to(inputs.device)
        inputs = inputs + (noise - 0.5) * feature_noise
    pair_valid = valid[:, 1:] & valid[:, :-1]
    targets = target_hidden[:, 1:]
    lm_head = head.get_output_embeddings()
    with torch.no_grad():
        target_probs = lm_head(targets).softmax(-1)
    if head.future is not None:
        if rollout_steps > 1:
            raise ValueError("rollout_steps > 1 trains token-by-token drafting depths; a head with num_future > 1 "
                             "drafts K tokens per forward: use rollout_steps=1")
        return _future_loss(head, tokens, inputs, targets, target_probs, pair_valid, feature_weight, ce_weight,
                            train_first_future)
    chains = _chain_weights(pair_valid, tokens, rollout_steps)
    result: dict[str, torch.Tensor] = {}
    total = target_hidden.new_zeros(())
    for depth, predicted in enumerate(rollout_features(head, tokens, inputs, pair_valid, rollout_steps), start=1):
        weight = (pair_valid if depth == 1 else chains[depth - 1]).to(predicted.dtype)
        count = weight.sum().clamp_min(1.0)
        feature_loss = (nn.functional.smooth_l1_loss(predicted, targets, reduction="none").mean(-1)
                        * weight).sum() / count
        logits = lm_head(predicted.to(lm_head.weight.dtype))
        ce_loss = (-(target_probs * logits.log_softmax(-1)).sum(-1) * weight).sum() / count
        agree = (logits.argmax(-1) == target_probs.argmax(-1)).to(weight.dtype)
        total = total + feature_weight * feature_loss + ce_weight * ce_loss
        if depth == 1:
            top1 = (agree * weight).sum() / count
            result.update(feature_loss=feature_loss.detach(), ce_loss=ce_loss.detach(), top1=top1.detach())
        if rollout_steps > 1:
            chain = chains[depth - 1].to(agree.dtype)
            result[f"top1_depth{depth}"] = ((agree * chain).sum() / chain.sum().clamp_min(1.0)).detach()
    return {"loss": total / rollout_steps, **result}


def _future_loss(head: EagleHead, tokens: torch.Tensor | None, inputs: torch.Tensor, targets: torch.Tensor,
                 target_probs: torch.Tensor, pair_valid: torch.Tensor, feature_weight: float, ce_weight: float,
                 train_first_future: bool = True) -> dict[str, torch.Tensor]:
    """:func:`eagle_loss` of a head with K futures: future k + 1 (k = 0..K-1) of the pair at slot j predicts
    ``targets`` at slot j + k, counted where slots j..j+k can be one drafting chain (:func:`_chain_weights`;
    future 1 over every valid pair, as the plain head's loss). The loss is the mean over the trained futures
    (all, or 2..K) of SmoothL1 + CE; "top1" is future 1's agreement and "top1_future{k}" (k = 1..K) every
    future's over its slots."""
    futures = head.readout(rollout_features(head, tokens, inputs, pair_valid, 1)[0])  # [B, T, K, d]
    count_k = futures.shape[2]
    chains = _chain_weights(pair_valid, tokens, count_k)
    lm_head = head.get_output_embeddings()
    total = futures.new_zeros(())
    result: dict[str, torch.Tensor] = {}
    length = targets.shape[1]
    for k in range(count_k):
        predicted = futures[:, : length - k, k]
        weight = (pair_valid if k == 0 else chains[k][:, k:]).to(predicted.dtype)
        count = weight.sum().clamp_min(1.0)
        feature_loss = (nn.functional.smooth_l1_loss(predicted, targets[:, k:], reduction="none").mean(-1)
                        * weight).sum() / count
        logits = lm_head(predicted.to(lm_head.weight.dtype))
        probs = target_probs[:, k:]
        ce_loss = (-(probs * logits.log_softmax(-1)).sum(-1) * weight).sum() / count
        if k or train_first_future:
            total = total + feature_weight * feature_loss + ce_weight * ce_loss
        agree = (logits.argmax(-1) == probs.argmax(-1)).to(weight.dtype)
        result[f"top1_future{k + 1}"] = ((agree * weight).sum() / count).detach()
        if k == 0:
            result.update(feature_loss=feature_loss.detach(), ce_loss=ce_loss.detach(), top1=result["top1_future1"])
    return {"loss": total / (count_k if train_first_future else count_k - 1), **result}


def rollout_features(head: EagleHead, input_ids: torch.Tensor | None, features: torch.Tensor,
                     valid: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's predicted features at drafting depths 1..``steps`` for every slot, in parallel.

    Slot i holds the pair (x_i, h_{i-1}) (``input_ids``, ``features`` ``[B, T, d]``, ``valid`` ``[B, T]``).
    Depth 1 is teacher forcing. Depth d at slot i is step d of a drafting chain rooted at slot i-d+1: its
    input feature is depth d-1's prediction at slot i-1, and it sees the true slots up to the root and
    the chain's own slots (depth m at slot i-d+m, m = 2..d), exactly what the drafter's KV cache holds
    at that step. Each depth is one pass of the head over the concatenated depths 1..d with that
    visibility (earlier depths are recomputed: the head is one layer and d is small).

    Returns ``steps`` tensors ``[B, T, d]`` (slots whose chain is not valid hold finite garbage).
    """
    length = features.shape[1]
    positions = (valid.long().cumsum(1) - 1).clamp_min(0)
    chunk_features, outputs = [features], []
    for depth in range(1, steps + 1):
        if depth > 1:  # depth d's input at slot i: depth d-1's prediction at slot i-1
            previous = outputs[-1]
            chunk_features.append(torch.cat([torch.zeros_like(previous[:, :1]), previous[:, :-1]], 1))
        ids = None if input_ids is None else input_ids.repeat(1, depth)
        embeds = head.fuse(ids, torch.cat(chunk_features, 1))
        mask = valid.long() if depth == 1 else _rollout_visibility(valid, depth)
        hidden = head.decoder(inputs_embeds=embeds, attention_mask=mask, position_ids=positions.repeat(1, depth),
                              use_cache=False).last_hidden_state
        outputs.append(hidden[:, -length:])
    return outputs


def _rollout_visibility(valid: torch.Tensor, depth: int) -> torch.Tensor:
    """Boolean ``[B, 1, dT, dT]`` visibility over depths 1..d of T slots each (see :func:`rollout_features`):
    a query of depth l at slot i sees true slots j <= i-l+1 (valid ones) and depth m's slot i-l+m, 2 <= m <= l."""
    batch, length = valid.shape
    slot = torch.arange(length, device=valid.device).repeat(depth)
    level = torch.arange(1, depth + 1, device=valid.device).repeat_interleave(length)
    q_slot, q_level, k_slot, k_level = slot[:, None], level[:, None], slot[None], level[None]
    true_context = (k_level == 1) & (k_slot <= q_slot - q_level + 1)
    own_chain = (k_level >= 2) & (k_level <= q_level) & (k_slot == q_slot - q_level + k_level)
    keys = torch.cat([valid, valid.new_ones(batch, (depth - 1) * length)], 1)
    return ((true_context | own_chain).unsqueeze(0) & keys.unsqueeze(1)).unsqueeze(1)


def _chain_weights(valid: torch.Tensor, input_ids: torch.Tensor | None, steps: int) -> list[torch.Tensor]:
    """Per depth d, the slots that can be step d of a drafting chain: slots i-d+1..i are valid and carry
    tokens (a chain starts at a token slot and never crosses padding or the condition)."""
    link = valid if input_ids is None else valid & (input_ids >= 0)
    weights, chain = [link], link
    for depth in range(2, steps + 1):
        shifted = torch.cat([link.new_zeros(link.shape[0], depth - 1), link[:, : link.shape[1] - depth + 1]], 1)
        chain = chain & shifted
        weights.append(chain)
    return weights
