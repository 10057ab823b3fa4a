"""Supervised training of the shapes captioner (:mod:`mmspec.models.shapes_vlm`): batches and answer loss.

:func:`training_batch` turns examples of :func:`~mmspec.models.shapes_vlm.build_training_set` into model
inputs with a mask of the answer tokens; :func:`answer_loss` is the (optionally weighted) next-token
cross-entropy over those tokens. The model file holds the networks, processor and data; this module holds
what only training needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmspec.models.shapes_vlm import VIDEO_FRAMES, pixel_values_from_uint8


def training_batch(data: dict, rows: Sequence[int], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Model inputs of training examples ``rows`` of :func:`build_training_set`: right-padded
    ``input_ids`` / ``attention_mask`` ``[B, L]``, ``pixel_values [N_frames, 3, 64, 64]`` (rows' frames in
    order) and ``loss_mask [B, L]``, True where ``input_ids`` is an answer token (``</s>`` included); plus
    ``patch_classes [N_frames, 64, 5]`` and ``patch_offsets [N_frames, 64, 2]`` when ``data`` has them."""
    examples = [data["examples"][r] for r in rows]
    length = max(len(e["ids"]) for e in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), length), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), length), dtype=torch.bool)
    frames, label_rows = [], []
    num_images = data["images"].shape[0]
    for b, e in enumerate(examples):
        n = len(e["ids"])
        ids[b, :n] = torch.tensor(e["ids"])
        attention[b, :n] = 1
        loss_mask[b, e["start"]:n] = True
        if e["video"]:
            frames.append(data["videos"][e["ref"]])
            label_rows += [num_images + e["ref"] * VIDEO_FRAMES + t for t in range(VIDEO_FRAMES)]
        else:
            frames.append(data["images"][e["ref"]][None])
            label_rows.append(e["ref"])
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask,
             "pixel_values": pixel_values_from_uint8(torch.cat(frames))}
    if "patch_classes" in data:
        batch["patch_classes"] = data["patch_classes"][label_rows].long()
        batch["patch_offsets"] = data["patch_offsets"][label_rows]
    return batch


def answer_loss(model, batch: dict[str, torch.Tensor], row_weights: torch.Tensor | None = None,
                token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """Summed next-token cross-entropy over the answer tokens of a :func:`training_batch`, and their count.
    A batch without ``pixel_values`` is read blind: the placeholders keep the ``<image>`` token embedding,
    which is what a draft model sees in transformers' assisted generation (it never gets the pixels).

    ``row_weights`` (float ``[B]``, optional) counts every answer token of row b ``row_weights[b]`` times and
    ``token_weights`` (float ``[B, L]`` like ``input_ids``, optional) counts answer token ``input_ids[b, t]``
    ``token_weights[b, t]`` times (both given: their product), in the sum and in the count, so
    ``sum / count`` stays a (weighted) mean per token."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   pixel_values=batch.get("pixel_values")).logits  # [B, L, V]
    target = batch["loss_mask"][:, 1:]  # position t predicts token t + 1
    losses = torch.nn.functional.cross_entropy(logits[:, :-1][target].float(), batch["input_ids"][:, 1:][target],
                                               reduction="none")
    if row_weights is None and token_weights is None:
        return losses.sum(), int(target.sum())
    weights = torch.ones(target.shape, dtype=torch.float32, device=losses.device)
    if row_weights is not None:
        if row_weights.shape != (target.shape[0],):
            raise ValueError(f"row_weights must have shape [{target.shape[0]}], got {tuple(row_weights.shape)}")
        weights = weights * row_weights.float()[:, None]
    if token_weights is not None:
        if token_weights.shape != batch["input_ids"].shape:
            raise ValueError(f"token_weights must have the shape of input_ids {tuple(batch['input_ids'].shape)}, "
                             f"got {tuple(token_weights.shape)}")
        weights = weights * token_weights[:, 1:].float()
    weights = weights[target]
    return (losses * weights).sum(), float(weights.sum())
