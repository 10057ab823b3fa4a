"""Recipe: the target and the standalone draft captioner of the ``mmspec/shapes-vlm`` zoo entry.

Trains a ``LlavaForConditionalGeneration`` of :func:`mmspec.models.shapes_vlm.shapes_vlm_config` from
scratch on CPU on the shapes world: detailed descriptions, short captions and question answering on
64x64 images, narrations and captions of 4-frame videos (see :mod:`mmspec.models.shapes_vlm`). Only the
answer tokens (and ``</s>``) are in the language-model loss. A training-only linear probe on the projected
image features adds an auxiliary loss from the scenes' ground truth (per 8x8-pixel patch: the colour,
shape, size and region of the object covering it and the offset to its centre,
:func:`mmspec.models.shapes_vlm.patch_labels`): without it the from-scratch vision tower stayed nearly
unused for hundreds of steps (the prototype's answers barely changed when the images were shuffled); the
probe is discarded, the saved model is a plain LLaVA. Deterministic for a seed and thread count; resumable:
the training set is rendered once into ``--work/data.pt``, checkpoints go to ``--work/checkpoint.pt``
every ``--save-every`` steps and the loss to ``--work/log.jsonl``; rerunning the same command continues.
The deliverable (fp16 safetensors, generation config, processor) is written to ``--out`` at every save.

    python -m mmspec.models.recipes.train_vlm --size target --out models/zoo/shapes-vlm/target
    python -m mmspec.models.recipes.train_vlm --size draft --out models/zoo/shapes-vlm/draft

A later stage starts from a trained captioner (``--init FOLDER``: its weights, a fresh optimiser and
schedule, no vision stage) in its own ``--work`` folder, typically on another training mix, e.g. one
enriched in scenes whose descriptions compare the listed objects (``--duplicate-fraction``, see
:func:`mmspec.models.shapes_vlm.build_training_set`); ``--aux-weight 0`` keeps the fresh patch probe from
pushing on the trained vision tower. ``--grow-text-layers`` with ``--override text_layers=N`` starts a
deeper text model from the trained one: its layers are spread over the N (8 -> 12: two old, one new, ...)
and each inserted layer starts as the identity (its two projections into the residual stream at zero), so
training continues from the trained captioner's exact outputs with more depth to use;
``--grow-text-width`` with ``--override text_dim=D text_heads=H text_ffn=F`` (same head width) starts a
wider one whose new channels, heads and MLP units start silent (:func:`widen_text_model`), likewise exact.
``--task-weight TASK=W`` counts a task's answer tokens W times in the loss, ``--name-weight W`` the description tokens that
decide how far a name is qualified (the word after "the"; tried, docs/zoo_shapes_vlm.md, not used by the zoo).
``--referent-weight W`` adds a training-only probe on one text layer (``--referent-layer``, default the
middle one) that must read, at each "the" before a name in a description, the colour and shape of the
object named (:class:`ReferentProbe`: the identity the qualification decision needs at that position).
``--lookalike-weight W`` (``--lookalike-layer``) likewise adds :class:`LookAlikeProbe`: at the shape word of
each listed object, whether an earlier one shares its colour, its shape, both (the comparison itself).

Run long jobs in the background (``nohup ... &``). ``--device cuda`` trains on a GPU (batches are built
on the CPU and moved there; the saved model is the same CPU fp16 checkpoint); raise ``--max-tokens`` there
so that a step is a few large micro-batches rather than many small ones.
"""

from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig

from mmspec.models import shapes_vlm as sv
from mmspec.models.recipes.common import (
    add_device_argument,
    add_run_arguments,
    args_key,
    cached_data,
    grow_layer_stack,
    load_trained_weights,
    start_run,
    time_left,
    train_loop,
    widen_state_dict,
)
from mmspec.models.recipes.vlm_answer_loss import answer_loss, training_batch
from mmspec.world.scene import COLORS, SHAPES, SIZES

# Per size: steps, batch, peak learning rate (chosen with short prototype runs; see docs/zoo_shapes_vlm.md).
DEFAULTS: dict[str, dict] = {
    "target": dict(steps=2000, batch=32, lr=2e-3, vision_steps=3000, blind_fraction=0.0),
    "draft": dict(steps=2000, batch=32, lr=2e-3, vision_steps=3000, blind_fraction=0.3),
    "tiny": dict(steps=20, batch=4, lr=1e-3, vision_steps=2, blind_fraction=0.5),
}


def chunks_by_length(data: dict, rows: list[int], max_tokens: int) -> list[list[int]]:
    """Split ``rows`` into micro-batches of similar length (sorted by length, then cut so that a chunk's
    padded size ``rows x longest`` stays within ``max_tokens``): long video prompts and one-word answers
    do not pad each other."""
    rows = sorted(rows, key=lambda r: (len(data["examples"][r]["ids"]), r))
    out, current = [], []
    for r in rows:
        longest = len(data["examples"][r]["ids"])  # sorted: the newest row is the longest
        if current and (len(current) + 1) * longest > max_tokens:
            out.append(current)
            current = []
        current.append(r)
    if current:
        out.append(current)
    return out


PATCH_CLASS_COUNTS = (10, 5, 4, 4, 4)  # background + classes of sv.PATCH_FIELDS


class PatchProbe(nn.Module):
    """Training-only linear read-out of the projected image features ``[N, 64, D]``: per patch, logits of the
    :data:`sv.PATCH_FIELDS` classes and the offset to the covering object's centre."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, sum(PATCH_CLASS_COUNTS) + 2)

    def forward(self, features: torch.Tensor, classes: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Summed per-frame loss: mean over patches of the class cross-entropies, plus 4x the squared offset
        error (patch units) averaged over the patches; ``classes [N, 64, 5]``, ``offsets [N, 64, 2]``."""
        out = self.proj(features.float())  # [N, 64, sum(classes) + 2]
        loss = features.new_zeros((), dtype=torch.float32)
        start = 0
        for field, count in enumerate(PATCH_CLASS_COUNTS):
            logits = out[..., start:start + count]
            loss = loss + nn.functional.cross_entropy(logits.flatten(0, 1), classes[..., field].flatten(),
                                                      reduction="sum") / classes.shape[1]
            start += count
        on_object = (classes[..., 0] > 0).unsqueeze(-1)  # [N, 64, 1]
        error = ((out[..., start:] - offsets) ** 2 * on_object).sum()
        return loss + 4.0 * error / classes.shape[1]


class Trainee(nn.Module):
    """What the optimiser sees: the VLM and its training-only probes (the checkpoint holds them all): the
    patch probe, with ``referent_layer`` set the :class:`ReferentProbe` reading that text layer, and with
    ``lookalike_layer`` set the :class:`LookAlikeProbe` reading that one."""

    def __init__(self, vlm: nn.Module, referent_layer: int | None = None, lookalike_layer: int | None = None) -> None:
        super().__init__()
        self.vlm = vlm
        dim = vlm.config.text_config.hidden_size
        self.probe = PatchProbe(dim)
        self.referent_layer, self.lookalike_layer = referent_layer, lookalike_layer
        layers = vlm.config.text_config.num_hidden_layers
        for name, layer in (("referent_layer", referent_layer), ("lookalike_layer", lookalike_layer)):
            if layer is not None and not 0 <= layer < layers:
                raise ValueError(f"{name} must be a text layer index in [0, {layers}), got {layer}")
        if referent_layer is not None:
            self.referent = ReferentProbe(dim)
        if lookalike_layer is not None:
            self.lookalike = LookAlikeProbe(dim)


#: The word before every referring name in a description ("the pink diamond is to the left of the small
#: pink square"): the token after it decides how far the name is qualified (colour, size, region).
NAME_CUE = "the"


def name_token_weights(input_ids: torch.Tensor, weighted_rows: torch.Tensor, cue_id: int,
                       weight: float) -> torch.Tensor:
    """Token weights ``[B, L]`` for :func:`answer_loss`: ``weight`` for each token that follows ``cue_id``
    in the rows where ``weighted_rows`` (bool ``[B]``) is set, 1 elsewhere.

    With the cue :data:`NAME_CUE` in descriptions these are the tokens that decide a name's qualification
    (the size word of "the small pink square", or the colour word of "the pink diamond" when no look-alike
    needs the size): about one answer token in six, among them the ones a trained captioner still gets
    wrong."""
    after_cue = torch.zeros_like(input_ids, dtype=torch.bool)
    after_cue[:, 1:] = input_ids[:, :-1] == cue_id
    weights = torch.ones(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    weights[after_cue & weighted_rows[:, None]] = weight
    return weights


class _PositionProbe(nn.Module):
    """A training-only linear read-out of one text layer's hidden states at some labelled positions."""

    def __init__(self, dim: int, outputs: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, outputs)

    def _summed(self, hidden: torch.Tensor, labelled: torch.Tensor,
                loss_of: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, int]:
        """``loss_of(logits)`` of the ``labelled`` (bool ``[B, L]``) positions of ``hidden [B, L, D]`` and how
        many positions that is (a zero loss when there are none)."""
        count = int(labelled.sum())
        if count == 0:
            return hidden.new_zeros((), dtype=torch.float32), 0
        return loss_of(self.proj(hidden[labelled].float())), count


class ReferentProbe(_PositionProbe):
    """Training-only linear read-out, from one text layer's hidden state at the word "the" before a name in
    a description's relation sentence, of the colour and shape of the object that name refers to.

    Why: whether a name needs its size ("the small red circle") depends on whether another object shares
    *both* its colour and its shape, and the captioner decides it at that one position, before it writes
    the colour and shape. Trained captioners behave as if they only knew whether the colour is shared and
    whether the shape is (docs/zoo_shapes_vlm.md: look-alikes under-qualified two times in three); this
    probe asks a middle layer to hold the referent's identity at the decision, so the layers above it can
    compare that conjunction with the listed objects."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim, len(COLORS) + len(SHAPES))

    def forward(self, hidden: torch.Tensor, colours: torch.Tensor, shapes: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Summed colour + shape cross-entropy over the labelled positions of ``hidden [B, L, D]`` (labels
        ``[B, L]``, -100 = none), and how many positions that is."""
        labelled = colours >= 0

        def loss_of(logits: torch.Tensor) -> torch.Tensor:
            cross_entropy = nn.functional.cross_entropy
            return (cross_entropy(logits[:, :len(COLORS)], colours[labelled], reduction="sum")
                    + cross_entropy(logits[:, len(COLORS):], shapes[labelled], reduction="sum"))

        return self._summed(hidden, labelled, loss_of)


class NameVocab:
    """Lookup tables over a tokenizer's ids for the name probes' targets (:func:`referent_targets`,
    :func:`lookalike_targets`): the cue word :data:`NAME_CUE`, which ids are articles and sizes, and each
    id's colour and shape class (index in the world's ``COLORS`` / ``SHAPES``; -100 for others)."""

    def __init__(self, tokenizer) -> None:
        def ids(words) -> list[int]:
            out = tokenizer.convert_tokens_to_ids(list(words))
            if tokenizer.unk_token_id in out:
                raise ValueError(f"the tokenizer lacks some of the words {list(words)}")
            return out

        self.cue = ids([NAME_CUE])[0]
        self.is_article = torch.zeros(len(tokenizer), dtype=torch.bool)
        self.is_article[ids(["a", "an"])] = True
        self.is_size = torch.zeros(len(tokenizer), dtype=torch.bool)
        self.is_size[ids(SIZES)] = True
        self.colour_class = torch.full((len(tokenizer),), -100, dtype=torch.long)
        self.colour_class[ids(COLORS)] = torch.arange(len(COLORS))
        self.shape_class = torch.full((len(tokenizer),), -100, dtype=torch.long)
        self.shape_class[ids(SHAPES)] = torch.arange(len(SHAPES))

    def checked(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` on the CPU, or ``ValueError`` if an id is outside the tokenizer the tables index."""
        ids = input_ids.cpu()
        if ids.numel() and int(ids.max()) >= self.is_size.shape[0]:
            raise ValueError(f"token id {int(ids.max())} is outside the tokenizer the NameVocab was built from")
        return ids


def _shifted(ids: torch.Tensor, k: int) -> torch.Tensor:
    """``ids [B, L]`` moved so that position p holds the token at p + k (k < 0: k places back), id 0 (padding)
    where that falls outside the row."""
    pad = ids.new_zeros(ids.shape[0], abs(k))
    return torch.cat([ids[:, k:], pad], dim=1) if k >= 0 else torch.cat([pad, ids[:, :k]], dim=1)


def referent_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, rows: torch.Tensor, vocab: NameVocab
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Colour and shape classes ``[B, L]`` (-100 where none) of the object named after each answer token
    "the" that starts a name, "the [size] colour shape" (as relation sentences name objects), in the rows
    where ``rows`` (bool ``[B]``) is set; ``loss_mask`` marks the answer tokens (:func:`training_batch`)."""
    ids = vocab.checked(input_ids)
    sized = vocab.is_size[_shifted(ids, 1)]
    colour = vocab.colour_class[torch.where(sized, _shifted(ids, 2), _shifted(ids, 1))]
    shape = vocab.shape_class[torch.where(sized, _shifted(ids, 3), _shifted(ids, 2))]
    named = (ids == vocab.cue) & (colour >= 0) & (shape >= 0) & loss_mask.cpu().bool() & rows.cpu()[:, None]
    none = torch.full_like(colour, -100)
    return (torch.where(named, colour, none).to(input_ids.device),
            torch.where(named, shape, none).to(input_ids.device))


class LookAlikeProbe(_PositionProbe):
    """Training-only linear read-out, from one text layer's hidden state at the shape word of each object a
    description lists ("there is a small red *circle* ..."), of whether an object listed before it has the
    same colour, the same shape, and both (three yes/no logits).

    Why: a name needs its size exactly when a look-alike (same colour *and* shape) exists, and trained
    captioners behave as if they only compared colours and shapes separately (docs/zoo_shapes_vlm.md). This
    asks for the conjunction on every listed object, where all the earlier objects are in view, so the
    model has to build the colour-and-shape comparison that the relation names need, on four positions
    per description instead of at the rare look-alike name."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim, 3)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Summed binary cross-entropy of the three answers over the labelled positions of ``hidden [B, L,
        D]`` (labels ``[B, L, 3]`` of 0 / 1, -100 = none), and how many positions that is."""
        labelled = labels[..., 0] >= 0
        return self._summed(hidden, labelled, lambda logits: nn.functional.binary_cross_entropy_with_logits(
            logits, labels[labelled].float(), reduction="sum"))


def lookalike_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, rows: torch.Tensor, vocab: NameVocab
                      ) -> torch.Tensor:
    """Labels ``[B, L, 3]`` for :class:`LookAlikeProbe` (-100 where none): at the shape word of each listed
    object, "a / an size colour shape" among the answer tokens of the rows where ``rows`` is set, whether an
    object listed earlier in the same answer has its colour, its shape, both (1 / 0)."""
    ids = vocab.checked(input_ids)
    colour, shape = vocab.colour_class[_shifted(ids, -1)], vocab.shape_class[ids]
    listing = ((shape >= 0) & (colour >= 0) & vocab.is_size[_shifted(ids, -2)] & vocab.is_article[_shifted(ids, -3)]
               & loss_mask.cpu().bool() & rows.cpu()[:, None])
    labels = torch.full((*ids.shape, 3), -100, dtype=torch.long)
    for b, positions in enumerate(listing.tolist()):  # a few listed objects per row, compared in order
        listed: list[tuple[int, int]] = []
        for p in (p for p, is_listed in enumerate(positions) if is_listed):
            kind = int(colour[b, p]), int(shape[b, p])
            labels[b, p] = torch.tensor([any(c == kind[0] for c, _ in listed), any(h == kind[1] for _, h in listed),
                                         kind in listed])
            listed.append(kind)
    return labels.to(input_ids.device)


def _layer_output(output):
    """A decoder layer's hidden states, whether it returns them alone or first in a tuple."""
    return output[0] if isinstance(output, tuple) else output


def make_loss_fn(trainee: Trainee, data: dict, max_tokens: int = 4096, aux_weight: float = 1.0,
                 blind_fraction: float = 0.0, task_weights: dict[str, float] | None = None,
                 device: str | torch.device = "cpu", name_weight: float = 1.0, name_cue_id: int | None = None,
                 referent_weight: float = 0.0, name_vocab: NameVocab | None = None,
                 lookalike_weight: float = 0.0):
    """``loss_fn(indices)`` for :func:`train_loop`: mean cross-entropy per answer token over the batch, plus
    ``aux_weight`` x the patch probe's loss per frame (when the data carries patch labels). Each length
    chunk is read blind (no ``pixel_values``) with probability ``blind_fraction`` (torch's RNG, which the
    checkpoints keep): the draft learns to draft from the prompt alone too, as it must in transformers'
    assisted generation, which never passes the pixels to the assistant.

    ``task_weights`` (task name -> weight, 1 for tasks not named) counts each answer token of a task's
    examples that many times: a one-word ``qa`` answer is about 1 % of a batch's answer tokens next to
    90-token descriptions, too little gradient for the question-answering path to be learnt well.

    ``referent_weight`` (> 0 needs a trainee built with ``referent_layer`` and ``name_vocab``) adds that
    many times the :class:`ReferentProbe`'s loss per labelled name of the descriptions, ``lookalike_weight``
    (> 0 needs ``lookalike_layer`` and the vocab too) the :class:`LookAlikeProbe`'s per listed object.

    Batches are built on the CPU (the blind draws use torch's CPU generator) and moved to ``device``."""
    projector = trainee.vlm.model.multi_modal_projector
    probes = {}  # probe name -> (weight, text layer index, loss of (hidden, target-builder arguments))
    for name, weight, layer, probe_loss in (
            ("referent", referent_weight, trainee.referent_layer,
             lambda hidden, args: trainee.referent(hidden, *referent_targets(*args))),
            ("lookalike", lookalike_weight, trainee.lookalike_layer,
             lambda hidden, args: trainee.lookalike(hidden, lookalike_targets(*args)))):
        if weight:
            check_loss_weight(f"{name}_weight", weight)
            if layer is None or name_vocab is None:
                raise ValueError(f"{name}_weight > 0 needs a Trainee built with {name}_layer and a name_vocab")
            probes[name] = (weight, layer, probe_loss)
    text_layers = trainee.vlm.model.language_model.layers
    task_weights = check_task_weights(task_weights or {})
    name_weight = check_loss_weight("name_weight", name_weight)
    if name_weight != 1.0 and name_cue_id is None:
        raise ValueError("name_weight != 1 needs name_cue_id, the token id of NAME_CUE")

    def loss_fn(index: torch.Tensor) -> torch.Tensor:
        total, count, aux, frames = 0.0, 0, 0.0, 0
        probe_sums = {name: [0.0, 0] for name in probes}  # summed loss, labelled positions
        for rows in chunks_by_length(data, index.tolist(), max_tokens):
            batch = {key: value.to(device) for key, value in training_batch(data, rows).items()}
            if blind_fraction and torch.rand(()) < blind_fraction:
                batch.pop("pixel_values")
            captured, hidden = [], {}
            handles = [projector.register_forward_hook(lambda module, args, output, store=captured: store.append(output))]
            for layer in {layer for _, layer, _ in probes.values()}:
                handles.append(text_layers[layer].register_forward_hook(
                    lambda module, args, output, layer=layer, store=hidden: store.__setitem__(layer, _layer_output(output))))
            weights = None
            if task_weights:
                weights = torch.tensor([task_weights.get(data["examples"][r]["task"], 1.0) for r in rows], device=device)
            describe = None
            if name_weight != 1.0 or probes:
                describe = torch.tensor([data["examples"][r]["task"] == "describe" for r in rows], device=device)
            token_weights = None
            if name_weight != 1.0:
                token_weights = name_token_weights(batch["input_ids"], describe, name_cue_id, name_weight)
            try:
                loss, n = answer_loss(trainee.vlm, batch, weights, token_weights)
            finally:
                for handle in handles:
                    handle.remove()
            total, count = total + loss, count + n
            if aux_weight and captured and "patch_classes" in batch:
                aux = aux + trainee.probe(captured[0], batch["patch_classes"], batch["patch_offsets"])
                frames += captured[0].shape[0]
            for name, (_, layer, probe_loss) in probes.items():
                loss, n = probe_loss(hidden[layer], (batch["input_ids"], batch["loss_mask"], describe, name_vocab))
                probe_sums[name][0] += loss
                probe_sums[name][1] += n
        out = total / max(count, 1) + aux_weight * aux / max(frames, 1)
        for name, (weight, _, _) in probes.items():
            out = out + weight * probe_sums[name][0] / max(probe_sums[name][1], 1)
        return out

    return loss_fn


def check_loss_weight(what: str, weight: float) -> float:
    """``weight`` as a float if it is a finite positive number (a loss weight), else ``ValueError`` naming ``what``."""
    if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"{what} must be a finite positive number, got {weight!r}")
    return float(weight)


def check_task_weights(task_weights: dict[str, float]) -> dict[str, float]:
    """Validate a task -> loss weight mapping (known tasks, finite positive weights)."""
    for task in task_weights:
        if task not in sv.TASKS:
            raise ValueError(f"unknown task {task!r} in task weights; tasks: {list(sv.TASKS)}")
    return {task: check_loss_weight(f"the weight of task {task!r}", weight) for task, weight in task_weights.items()}


def parse_task_weights(items: list[str]) -> dict[str, float]:
    """``["qa=20", ...]`` (the ``--task-weight`` option) -> ``{"qa": 20.0}``."""
    out = {}
    for item in items:
        task, _, value = item.partition("=")
        try:
            out[task] = float(value)
        except ValueError:
            raise ValueError(f"--task-weight takes TASK=NUMBER entries, got {item!r}") from None
    return check_task_weights(out)


def make_vision_loss_fn(trainee: Trainee, data: dict, device: str | torch.device = "cpu"):
    """Stage 1 ``loss_fn(frame indices)``: the patch probe's loss per frame on the vision tower + projector
    alone (no language model), over every frame of the training set (images, then the videos' frames)."""
    num_images = data["images"].shape[0]
    frames = data["videos"].flatten(0, 1)  # [V * T, H, W, 3]

    def loss_fn(index: torch.Tensor) -> torch.Tensor:
        pixels = torch.stack([data["images"][i] if i < num_images else frames[i - num_images] for i in index.tolist()])
        features = trainee.vlm.model.get_image_features(pixel_values=sv.pixel_values_from_uint8(pixels).to(device))
        features = torch.stack(list(features.pooler_output))  # [N, 64, D] projected image features
        loss = trainee.probe(features, data["patch_classes"][index].long().to(device),
                             data["patch_offsets"][index].to(device))
        return loss / index.shape[0]

    return loss_fn


#: Prefix of the text model's decoder layers in a ``LlavaForConditionalGeneration`` state dict, and the
#: projections of a layer that write into the residual stream (zero in a grown layer: the identity).
TEXT_LAYERS_PREFIX = "model.language_model.layers."
RESIDUAL_OUTPUTS = ("self_attn.o_proj", "mlp.down_proj")


#: What :func:`widen_state_dict` needs to know of a LLaVA's Llama text model and projector (key suffixes).
TEXT_RESIDUAL_WRITERS = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "multi_modal_projector.linear_2.weight",
                         "multi_modal_projector.linear_2.bias")
TEXT_UNIT_READERS = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "multi_modal_projector.linear_2.weight")
TEXT_RESIDUAL_COLUMNS = ("embed_tokens.weight",)
TEXT_RMS_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "language_model.norm.weight")


def match_widened_norm_epsilon(vlm: nn.Module, trained_text_config) -> None:
    """Set the wider text model's RMSNorm epsilon to the trained one's times ``old width / new width``.

    Zero channels lower the mean square by that factor; with the epsilon scaled alike, the normalised old
    channels are exactly the trained model's (with the trained epsilon the difference is relative
    ``eps / mean square``, about 1e-4 on the small embeddings of the first layer). Written into the config
    too, so the saved model and a resumed run keep it. Idempotent."""
    text = vlm.config.text_config
    epsilon = trained_text_config.rms_norm_eps * trained_text_config.hidden_size / text.hidden_size
    text.rms_norm_eps = epsilon
    for module in vlm.model.language_model.modules():
        if hasattr(module, "variance_epsilon"):
            module.variance_epsilon = epsilon


def widen_text_model(trainee: Trainee, trained: nn.Module, folder: Path) -> dict[str, torch.Tensor]:
    """``trained``'s weights laid out for ``trainee``'s wider text model (``--grow-text-width``), computing the
    same outputs: :func:`widen_state_dict` with the LLaVA text model's writers, readers and norms. The two
    must agree on everything but the width: layers, head width, the vision tower."""
    old, new = trained.config.text_config, trainee.vlm.config.text_config
    old_head, new_head = old.hidden_size // old.num_attention_heads, new.hidden_size // new.num_attention_heads
    if old.num_hidden_layers != new.num_hidden_layers:
        raise ValueError(f"--grow-text-width: {folder} has {old.num_hidden_layers} text layers, the model to "
                         f"train {new.num_hidden_layers}; grow the width and the depth in separate stages")
    if old_head != new_head:
        raise ValueError(f"--grow-text-width keeps the head width: {folder} has heads of {old_head} channels, "
                         f"the model to train {new_head} (set text_heads = text_dim / {old_head})")
    if new.hidden_size < old.hidden_size or new.intermediate_size < old.intermediate_size:
        raise ValueError(f"--grow-text-width: the model to train (text_dim={new.hidden_size}, text_ffn="
                         f"{new.intermediate_size}) is narrower than {folder} (text_dim={old.hidden_size}, "
                         f"text_ffn={old.intermediate_size})")
    match_widened_norm_epsilon(trainee.vlm, old)
    return widen_state_dict(trainee.vlm.state_dict(), trained.state_dict(), old.hidden_size, new.hidden_size,
                            TEXT_RESIDUAL_WRITERS, TEXT_UNIT_READERS, TEXT_RESIDUAL_COLUMNS, TEXT_RMS_NORMS)


def check_captioner_folder(folder: Path) -> None:
    """``FileNotFoundError`` naming ``--init``'s folder if it holds no trained captioner."""
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"--init: no trained model at {folder}")


def init_from(trainee: Trainee, folder: Path, grow: bool = False, widen: bool = False) -> None:
    """Copy a trained captioner's weights into ``trainee.vlm`` (same architecture; the probe stays fresh).

    ``grow=True`` also accepts a captioner with fewer text-model layers: its layers are spread over the
    deeper text model and the inserted layers start as identities (:func:`grow_layer_stack`); ``widen=True``
    one with a narrower text model (fewer channels, heads of the same width, fewer MLP units), whose
    weights are embedded so that the new channels, heads and units start silent (:func:`widen_text_model`).
    Either way training starts from the trained captioner's exact outputs with more capacity to use."""
    if grow and widen:
        raise ValueError("grow the text model's depth and its width in separate stages, not both at once")
    check_captioner_folder(folder)
    trained = sv.load_model(folder)
    weights = trained.state_dict()
    if grow:
        old_layers = trained.config.text_config.num_hidden_layers
        new_layers = trainee.vlm.config.text_config.num_hidden_layers
        if old_layers > new_layers:  # in the recipe's terms (grown_layer_sources checks it too, generically)
            raise ValueError(f"--grow-text-layers: {folder} has {old_layers} text layers, more than the "
                             f"{new_layers} of the model to train")
        weights = grow_layer_stack(trainee.vlm.state_dict(), weights, TEXT_LAYERS_PREFIX, old_layers, new_layers,
                                   RESIDUAL_OUTPUTS)
    if widen:
        weights = widen_text_model(trainee, trained, folder)
    load_trained_weights(trainee.vlm, weights, str(folder))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=tuple(sv.MODEL_SIZES), default="target")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=None, help="default: per size (DEFAULTS)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--train-videos", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=4096, help="padded tokens per micro-batch")
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--aux-weight", type=float, default=1.0, help="weight of the patch-probe loss (0: off)")
    parser.add_argument("--vision-steps", type=int, default=None,
                        help="stage 1: steps of patch-probe training of the vision tower alone (default per size)")
    parser.add_argument("--vision-batch", type=int, default=64, help="frames per stage-1 step")
    parser.add_argument("--blind-fraction", type=float, default=None,
                        help="share of length chunks trained without pixels (default per size: draft 0.3)")
    parser.add_argument("--init", type=Path, default=None,
                        help="start from this trained captioner (a later stage: no vision stage, fresh schedule)")
    parser.add_argument("--duplicate-fraction", type=float, default=0.0,
                        help="share of image scenes redrawn with a shared colour or look-alike objects")
    parser.add_argument("--task-weight", nargs="*", default=[], metavar="TASK=W",
                        help="loss weight per answer token of a task's examples, e.g. qa=20 (default 1 each)")
    parser.add_argument("--name-weight", type=float, default=1.0,
                        help="loss weight of each description token after 'the' (the token that decides how far "
                             "a name is qualified; default 1)")
    parser.add_argument("--referent-weight", type=float, default=0.0,
                        help="weight of the referent probe's loss: a text layer's state at each 'the' before a "
                             "name in a description must give the named object's colour and shape (0: off)")
    parser.add_argument("--referent-layer", type=int, default=None,
                        help="the text layer (0-based) the referent probe reads (default: the middle one)")
    parser.add_argument("--lookalike-weight", type=float, default=0.0,
                        help="weight of the look-alike probe's loss: a text layer's state at each listed object's "
                             "shape word must tell whether an earlier listed object shares its colour, its shape, "
                             "both (0: off)")
    parser.add_argument("--lookalike-layer", type=int, default=None,
                        help="the text layer (0-based) the look-alike probe reads (default: the middle one)")
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=INT",
                        help="model size entries to change, e.g. text_dim=192 text_layers=6")
    parser.add_argument("--grow-text-layers", action="store_true",
                        help="with --init and --override text_layers=N: start a deeper text model from a "
                             "trained captioner (its layers spread out, the new ones starting as identities)")
    parser.add_argument("--grow-text-width", action="store_true",
                        help="with --init and --override text_dim=D text_heads=H text_ffn=F: start a wider text "
                             "model from a trained captioner (same head width; the new channels, heads and MLP "
                             "units start silent, so the outputs are the trained captioner's)")
    add_run_arguments(parser, "")
    add_device_argument(parser)
    parser.set_defaults(train_images=24000, difficulty=sv.DIFFICULTY, threads=1)
    args = parser.parse_args(argv)
    for key in ("steps", "batch", "lr", "vision_steps", "blind_fraction"):
        if getattr(args, key) is None:
            setattr(args, key, DEFAULTS[args.size][key])
    if str(args.work) in ("", "."):
        args.work = Path(f"runs/train_vlm_{args.size}")
    overrides = {}
    for item in args.override:
        key, _, value = item.partition("=")
        if not value.isdigit():
            raise ValueError(f"--override takes KEY=INT entries, got {item!r}")
        overrides[key] = int(value)
    task_weights = parse_task_weights(args.task_weight)
    check_loss_weight("--name-weight", args.name_weight)  # before the minutes of building the data
    for probe in ("referent", "lookalike"):
        if getattr(args, f"{probe}_weight"):
            check_loss_weight(f"--{probe}-weight", getattr(args, f"{probe}_weight"))
        elif getattr(args, f"{probe}_layer") is not None:
            raise ValueError(f"--{probe}-layer needs --{probe}-weight > 0")
    for flag, value in (("--grow-text-layers", args.grow_text_layers), ("--grow-text-width", args.grow_text_width)):
        if value and args.init is None:
            raise ValueError(f"{flag} grows a trained captioner: give it with --init")
    if args.init is not None:  # before the minutes of building the data
        check_captioner_folder(args.init)
    start_run(args)

    processor = sv.build_processor()
    data = cached_data(args.work, lambda: sv.build_training_set(args.train_images, args.train_videos, args.seed,
                                                                "train", difficulty=args.difficulty,
                                                                tokenizer=processor.tokenizer,
                                                                duplicate_fraction=args.duplicate_fraction,
                                                                workers=args.data_workers),
                       key=args_key(args, "train_images", "train_videos", "seed", "difficulty",
                                    "duplicate_fraction"))
    vlm = sv.build_model(args.size, seed=args.seed, **overrides)
    middle = vlm.config.text_config.num_hidden_layers // 2
    probe_layers = [(middle if layer is None else layer) if weight else None
                    for weight, layer in ((args.referent_weight, args.referent_layer),
                                          (args.lookalike_weight, args.lookalike_layer))]
    trainee = Trainee(vlm, *probe_layers)
    if args.init is not None:
        args.vision_steps = 0
        if not (args.work / "checkpoint.pt").is_file():
            init_from(trainee, args.init, grow=args.grow_text_layers, widen=args.grow_text_width)
        elif args.grow_text_width:  # a resumed run restores its weights; the widened epsilon is config, not weights
            match_widened_norm_epsilon(trainee.vlm, AutoConfig.from_pretrained(args.init).text_config)
    out = Path(args.out)

    def save(trained: Trainee) -> None:
        copy.deepcopy(trained.vlm).eval().to("cpu", torch.float16).save_pretrained(out)  # fp16 keeps the zoo small
        processor.save_pretrained(out)

    if args.vision_steps > 0:  # stage 1 (resumable on its own): vision tower + projector + probe
        stage1 = args.work / "vision"
        if not (stage1 / "done").is_file():
            train_loop(trainee, make_vision_loss_fn(trainee, data, args.device), data["patch_classes"].shape[0],
                       steps=args.vision_steps, batch=args.vision_batch, lr=args.lr, work=stage1,
                       save=lambda trained: None, save_every=args.save_every, device=args.device)
            (stage1 / "done").write_text("ok\n")
        else:
            trainee.load_state_dict(torch.load(stage1 / "checkpoint.pt", map_location="cpu")["model"])
    torch.manual_seed(args.seed + 1)  # stage 2 draws the same batches whether or not stage 1 ran in this process
    vocab = NameVocab(processor.tokenizer)
    loss_fn = make_loss_fn(trainee, data, args.max_tokens, args.aux_weight, args.blind_fraction, task_weights,
                           args.device, args.name_weight, vocab.cue, args.referent_weight, vocab, args.lookalike_weight)
    train_loop(trainee, loss_fn, len(data["examples"]), steps=args.steps, batch=args.batch, lr=args.lr,
               work=args.work, save=save, save_every=args.save_every, stop_at=args.stop_at, device=args.device,
               time_limit=time_left(args))


if __name__ == "__main__":
    main()
