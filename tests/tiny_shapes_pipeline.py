"""A tiny random ARImagePipeline over the real shapes world's words and the zoo's VQ tokenizer (32 px,
8x8 tokens), with an EAGLE head and MuLo-SD parts: what the command-line tools need to run end to end
in seconds. Its images are noise; tests check plumbing, not quality."""

from __future__ import annotations

from pathlib import Path

import torch

from mmspec.models.eagle import EagleHead
from mmspec.models.llamagen import LlamaGenTransformer
from mmspec.models.mulo import TokenUpsampler
from mmspec.models.text import WordTokenizer
from mmspec.models.tokenizers import load_zoo_tokenizer
from mmspec.pipelines import ARImagePipeline
from mmspec.world import vocabulary


def tiny_shapes_pipeline(seed: int = 0) -> ARImagePipeline:
    torch.manual_seed(seed)
    vq = load_zoo_tokenizer("vq")
    words = WordTokenizer(vocabulary())
    common = dict(n_head=2, multiple_of=16, model_type="t2i", vocab_size=vq.vocab_size, cls_token_num=16,
                  text_vocab_size=len(words), condition_rope="identity")
    target = LlamaGenTransformer(dim=32, n_layer=1, block_size=64, caption_dim=32, **common).eval()
    low = LlamaGenTransformer(dim=16, n_layer=1, block_size=16, caption_dim=16, **common).eval()
    head = EagleHead(hidden_size=32, vocab_size=vq.vocab_size, num_attention_heads=2).eval()
    pipe = ARImagePipeline(target, vq, head, words, mulo_drafter=low,
                           mulo_upsampler=TokenUpsampler(vocab_size=vq.vocab_size, ratio=2, dim=16).eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_tiny_shapes_pipeline(folder: Path) -> Path:
    tiny_shapes_pipeline().save_pretrained(folder)
    return folder
