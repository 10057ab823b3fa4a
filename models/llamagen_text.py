"""LlamaGen's text side: T5 caption features, and official checkpoints as pipeline components.

LlamaGen's text-to-image models (arXiv 2406.06525, ``t2i_XL_stage1_256.pt`` / ``stage2_512``) are not
conditioned on word ids but on the last hidden state of a T5 encoder (flan-t5-xl, width 2048) over the
caption: the caption is lower-cased and stripped, tokenized to ``cls_token_num`` = 120 tokens (padded and
truncated, end-of-sequence token included), encoded, and then laid out as LlamaGen's sampler does: the
valid tokens moved to the end of the 120 slots, the padding slots zeroed and masked out of attention.
:func:`caption_features` reproduces that with any transformers encoder and tokenizer, so an
:class:`~mmspec.pipelines.ARImagePipeline` built on an official checkpoint sees the features the model
was trained on. (LlamaGen's sampler also runs DeepFloyd's caption cleaning, which removes URLs, HTML and
some punctuation; plain prompts come out of it as they come out of ``lower().strip()``.)

:func:`load_llamagen_components` turns the official files (GPT checkpoint, VQ checkpoint, and for t2i a
local or hub T5 folder) into the keyword arguments of ``ARImagePipeline``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from mmspec.models.llamagen import LlamaGenTransformer
from mmspec.models.llamagen_vq import LlamaGenVQModel

#: LlamaGen's T5 caption length (``t5_feature_max_len``) and the encoder its t2i models were trained with.
LLAMAGEN_CAPTION_LENGTH = 120
LLAMAGEN_TEXT_ENCODER = "google/flan-t5-xl"


def preprocess_caption(text: str) -> str:
    """LlamaGen's caption preprocessing without the optional cleaning: lower case, outer spaces removed."""
    return text.lower().strip()


@torch.no_grad()
def caption_features(texts: Sequence[str], tokenizer: Any, text_encoder: Any, max_length: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """T5 features of ``texts`` as the encoder gives them: ``([B, max_length, d_model], mask [B, max_length])``.

    The tokenizer pads to ``max_length`` and truncates longer captions (keeping their first tokens, as
    LlamaGen's sampler does); the mask is 1 at real tokens (wherever the tokenizer put its padding).
    :meth:`~mmspec.models.llamagen.LlamaGenTransformer.pad_condition` then gives LlamaGen's layout.
    """
    batch = tokenizer([preprocess_caption(t) for t in texts], max_length=max_length, padding="max_length",
                      truncation=True, return_attention_mask=True, add_special_tokens=True, return_tensors="pt")
    device = next(text_encoder.parameters()).device
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    features = text_encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    return features, mask.long()


def check_text_encoder(transformer: Any, text_encoder: Any, tokenizer: Any) -> None:
    """A caption encoder fits a t2i transformer that reads caption features: both or neither of
    ``text_encoder`` and ``tokenizer``, only for a caption-feature model, with the caption width.

    Raises:
        ValueError: naming what does not fit.
    """
    if (text_encoder is None) != (tokenizer is None):
        raise ValueError("text_encoder and tokenizer come together (pass both or neither)")
    if text_encoder is None:
        return
    config = transformer.config
    if getattr(config, "model_type", None) != "t2i" or getattr(config, "text_vocab_size", None) is not None:
        raise ValueError("a text_encoder serves a t2i transformer that reads caption features "
                         "(text_vocab_size=None); this transformer takes class labels or word ids")
    width = getattr(text_encoder.config, "d_model", None) or getattr(text_encoder.config, "hidden_size", None)
    if width != config.caption_dim:
        raise ValueError(f"the text_encoder's features have width {width}, the transformer reads caption features of "
                         f"width {config.caption_dim} (LlamaGen's t2i models: flan-t5-xl, 2048)")


def load_text_encoder(path_or_id: str | os.PathLike, torch_dtype: torch.dtype | None = None,
                      **kwargs: Any) -> tuple[Any, Any]:
    """``(T5EncoderModel, tokenizer)`` from a local folder or hub id (e.g. a copy of ``google/flan-t5-xl``),
    in eval mode; ``kwargs`` go to both ``from_pretrained`` calls (``local_files_only``, ``revision`` ...)."""
    from transformers import AutoTokenizer, T5EncoderModel

    dtype = {} if torch_dtype is None else {"dtype": torch_dtype}
    encoder = T5EncoderModel.from_pretrained(path_or_id, **dtype, **kwargs).eval()
    return encoder, AutoTokenizer.from_pretrained(path_or_id, **kwargs)


def load_llamagen_components(gpt_checkpoint: str | os.PathLike, vq_checkpoint: str | os.PathLike,
                             text_encoder: str | os.PathLike | None = None, *, block_size: int = 256,
                             torch_dtype: torch.dtype | None = None, **gpt_config: Any) -> dict[str, Any]:
    """``transformer``, ``vqvae`` and, for t2i, ``text_encoder`` and ``tokenizer`` from LlamaGen's official
    files, ready for ``ARImagePipeline(**components, eagle_head=...)``.

    Args:
        gpt_checkpoint / vq_checkpoint: the GPT and VQ files
            (:meth:`~mmspec.models.llamagen.LlamaGenTransformer.from_llamagen_checkpoint`,
            :meth:`~mmspec.models.llamagen_vq.LlamaGenVQModel.from_llamagen_checkpoint`).
        text_encoder: t2i only: a folder or hub id of the T5 encoder and its tokenizer (flan-t5-xl for the
            official models); a c2i checkpoint takes none.
        block_size: image tokens per image (256 for 256 px, 576 for 384 px, 1024 for 512 px).
        torch_dtype: dtype of every model (default: each checkpoint's own).
        gpt_config: more config overrides for the GPT (e.g. ``n_head`` for a non-official width).

    Raises:
        ValueError: a t2i checkpoint without ``text_encoder`` or a c2i checkpoint with one; any loader
            error (missing files, foreign state dicts) as the loaders raise it.
    """
    transformer = LlamaGenTransformer.from_llamagen_checkpoint(gpt_checkpoint, block_size=block_size,
                                                               torch_dtype=torch_dtype, **gpt_config)
    vqvae = LlamaGenVQModel.from_llamagen_checkpoint(vq_checkpoint, torch_dtype=torch_dtype)
    components: dict[str, Any] = {"transformer": transformer, "vqvae": vqvae}
    t2i = transformer.config.model_type == "t2i"
    if t2i and text_encoder is None:
        raise ValueError(f"{gpt_checkpoint} is a text-to-image model: pass text_encoder (a folder or hub id of its "
                         f"T5 encoder, {LLAMAGEN_TEXT_ENCODER} for the official models)")
    if not t2i and text_encoder is not None:
        raise ValueError(f"{gpt_checkpoint} is class-conditioned: it takes no text_encoder")
    if t2i:  # ARImagePipeline checks the encoder's width against the transformer (check_text_encoder)
        components["text_encoder"], components["tokenizer"] = load_text_encoder(text_encoder, torch_dtype)
    return components
