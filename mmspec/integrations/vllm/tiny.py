"""Tiny checkpoints for testing and benchmarking the vLLM integration on a CPU (main environment).

* :func:`build_tiny_llama`: a random ``LlamaForCausalLM`` with the zoo's word-level tokenizer, saved the way
  vLLM loads it (``PreTrainedTokenizerFast``: the zoo's ``TokenizersBackend`` class name is newer than the
  transformers vLLM pins);
* :func:`build_tiny_llava`: a random ``LlavaForConditionalGeneration`` shaped like llava-1.5 (CLIP tower read at
  its penultimate layer, llava-hf's storage, a chat template without BOS) with the zoo VLM's tokenizer;
* :func:`build_tiny_qwen2_vl`: a random ``Qwen2VLForConditionalGeneration`` (M-RoPE language model, a one-block
  vision tower) with a Qwen-style tokenizer (no BOS, the four vision special tokens) and its processor;
* :func:`build_random_head`: an untrained :class:`~mmspec.models.eagle.EagleHead` or
  :class:`~mmspec.models.vlm_drafters.eagle_vlm.EagleVLMHead` sized for a target (lossless like any head; its
  acceptance is low).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mmspec.files import write_json_atomic

from .checkpoints import read_target
from .convert import WEIGHTS, vllm_weight_name

ZOO_TOKENIZER_FROM = "shapes-vlm/target"
#: attention head width: vLLM's CPU attention supports 32 and up, not 16
HEAD_DIM = 32


def _zoo_folder() -> Path:
    import mmspec.models.zoo as zoo_package

    return Path(zoo_package.__file__).resolve().parent / ZOO_TOKENIZER_FROM


def write_fast_tokenizer(source: Path, folder: Path) -> None:
    """Copy ``source/tokenizer.json`` into ``folder`` with a ``PreTrainedTokenizerFast`` config that keeps
    ``source``'s special tokens."""
    config = json.loads((source / "tokenizer_config.json").read_text())
    keep = {key: config[key] for key in ("bos_token", "eos_token", "pad_token", "unk_token") if key in config}
    shutil.copyfile(source / "tokenizer.json", folder / "tokenizer.json")
    write_json_atomic(folder / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast",
                                                         "clean_up_tokenization_spaces": False, **keep})


def _zoo_llama_config(hidden_size: int, num_layers: int) -> Any:
    """A small Llama language model over the zoo tokenizer's vocabulary (heads of width 32, one KV head)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=read_target(_zoo_folder()).vocab_size, hidden_size=hidden_size,
                       intermediate_size=4 * hidden_size, num_hidden_layers=num_layers,
                       num_attention_heads=hidden_size // HEAD_DIM, num_key_value_heads=1, max_position_embeddings=512,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def build_tiny_llama(folder: str | Path, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                     logit_scale: float = 8.0) -> Path:
    """Save a random Llama (fp32, the zoo tokenizer's vocabulary, heads of width 32) to ``folder``; returns the
    folder. ``hidden_size`` must be a multiple of 32. ``logit_scale`` multiplies the LM head's random weights:
    the default gives greedy text that is not one repeated token, 1 flatter distributions for sampling."""
    if hidden_size % HEAD_DIM:
        raise ValueError(f"hidden_size must be a multiple of {HEAD_DIM}, got {hidden_size}")
    import torch
    from transformers import LlamaForCausalLM

    source = _zoo_folder()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_zoo_llama_config(hidden_size, num_layers)).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(folder)
    write_fast_tokenizer(source, folder)
    return folder


#: Qwen2-VL's vision special tokens, appended to the zoo's word-level vocabulary in this order
QWEN_SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
#: the tiny Qwen2-VL's image side: 28-pixel patch pairs, so a 56x56 image is 4x4 patches, 2x2 tokens
QWEN_PATCH, QWEN_IMAGE_SIZE = 14, 56
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' or 'image' in item -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "<|im_end|>\n{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")


def build_tiny_qwen2_vl(folder: str | Path, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                        logit_scale: float = 8.0) -> Path:
    """Save a random Qwen2-VL to ``folder`` (fp32; returns the folder): the zoo's words plus Qwen's chat and
    vision special tokens (no BOS, as Qwen's tokenizer), M-RoPE over heads of width 32, a one-block vision
    tower whose 2x2 merge gives 4 tokens for a 56x56 image, and the ``Qwen2VLProcessor`` vLLM loads."""
    if hidden_size % HEAD_DIM:
        raise ValueError(f"hidden_size must be a multiple of {HEAD_DIM}, got {hidden_size}")
    import torch
    from tokenizers import Tokenizer
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_json = Tokenizer.from_file(str(_zoo_folder() / "tokenizer.json"))
    tokenizer_json.post_processor = None  # Qwen's tokenizer prepends no BOS
    tokenizer_json.add_special_tokens(["<|im_start|>", "<|im_end|>", *QWEN_SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer_json, eos_token="<|im_end|>", pad_token="<pad>",
                                        unk_token="<unk>")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_SPECIAL_TOKENS}
    vocab = 8 * -(-len(tokenizer) // 8)
    half = HEAD_DIM // 2  # M-RoPE splits a head's rotary half into (temporal, height, width) sections
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [half - 2 * (half // 4), half // 4, half // 4]}
    text = dict(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=hidden_size // HEAD_DIM, num_key_value_heads=1,
                max_position_embeddings=512, rope_parameters=rope, pad_token_id=0, bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    vision = dict(depth=1, embed_dim=2 * HEAD_DIM, num_heads=2, mlp_ratio=2, hidden_size=hidden_size,
                  patch_size=QWEN_PATCH, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(folder)
    pixels = QWEN_IMAGE_SIZE * QWEN_IMAGE_SIZE
    image_processor = Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=pixels, patch_size=QWEN_PATCH,
                                            merge_size=2, temporal_patch_size=2)
    video_processor = Qwen2VLVideoProcessor(min_pixels=pixels, max_pixels=pixels, patch_size=QWEN_PATCH,
                                            merge_size=2, temporal_patch_size=2)
    processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
                                 chat_template=QWEN_CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    return folder


#: the tiny LLaVA's image side, llava-1.5's processing at a small size: shortest edge resized to 28, centre crop
#: 28x28, 14-pixel patches, so 2x2 patch tokens (the CLS token dropped, as llava-1.5 does)
LLAVA_PATCH, LLAVA_IMAGE_SIZE = 14, 28
#: a llava-1.5 style chat template, in the zoo's words; like llava-hf's it writes no BOS
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}user: "
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
    "{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] }} {% endif %}{% endfor %}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def build_tiny_llava(folder: str | Path, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                     logit_scale: float = 8.0) -> Path:
    """Save a random LLaVA-1.5-shaped model to ``folder`` (fp32; returns the folder) the way llava-hf's
    checkpoints are stored, not through :func:`~.convert.convert_llava_for_vllm`: a two-layer CLIP tower read
    at its penultimate layer (``vision_feature_layer=-2``), a GELU projector, a Llama language model with the
    zoo VLM's tokenizer (``<image>`` included, BOS prepended), the CLIP image processor (resize, centre crop)
    and a stored chat template that writes no BOS."""
    if hidden_size % HEAD_DIM:
        raise ValueError(f"hidden_size must be a multiple of {HEAD_DIM}, got {hidden_size}")
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    source = _zoo_folder()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(source)  # saved with the processor below
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    if image_token_id == tokenizer.unk_token_id:
        raise RuntimeError(f"the zoo tokenizer in {source} has no <image> token")
    text = _zoo_llama_config(hidden_size, num_layers)
    vision = CLIPVisionConfig(hidden_size=2 * HEAD_DIM, intermediate_size=4 * HEAD_DIM, num_hidden_layers=2,
                              num_attention_heads=2, image_size=LLAVA_IMAGE_SIZE, patch_size=LLAVA_PATCH,
                              projection_dim=2 * HEAD_DIM, hidden_act="quick_gelu")
    tokens_per_image = (LLAVA_IMAGE_SIZE // LLAVA_PATCH) ** 2
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                         projector_hidden_act="gelu", vision_feature_select_strategy="default",
                         vision_feature_layer=-2, image_seq_length=tokens_per_image, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(folder)
    weights = folder / WEIGHTS  # llava-hf's names for the CLIP tower (transformers 5 saves shorter ones)
    save_file({vllm_weight_name(name): tensor for name, tensor in load_file(str(weights)).items()}, str(weights),
              metadata={"format": "pt"})
    image_processor = CLIPImageProcessor(size={"shortest_edge": LLAVA_IMAGE_SIZE}, do_center_crop=True,
                                         crop_size={"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=LLAVA_PATCH,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=LLAVA_CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    return folder


#: the head classes :func:`build_random_head` builds: the text-target head and the VLM one
RANDOM_HEAD_CLASSES = ("EagleVLMHead", "EagleHead")


def build_random_head(target: str | Path, folder: str | Path, seed: int = 0,
                      head_class: str = "EagleVLMHead") -> Path:
    """Save an untrained ``head_class`` (:data:`RANDOM_HEAD_CLASSES`) sized for ``target`` (its hidden size and
    vocabulary) to ``folder``."""
    if head_class not in RANDOM_HEAD_CLASSES:
        raise ValueError(f"head_class must be one of {RANDOM_HEAD_CLASSES}, got {head_class!r}")
    import torch

    from mmspec.models.eagle import EagleHead
    from mmspec.models.vlm_drafters.eagle_vlm import EagleVLMHead

    info = read_target(target)
    torch.manual_seed(seed)
    cls = EagleVLMHead if head_class == "EagleVLMHead" else EagleHead
    head = cls(hidden_size=info.hidden_size, vocab_size=info.vocab_size,
               num_attention_heads=max(1, info.hidden_size // HEAD_DIM), max_position_embeddings=512)
    with torch.no_grad():  # non-trivial norms and fc bias, so the export's mapping of each is exercised
        for name, parameter in head.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.copy_(1.0 + 0.1 * torch.randn_like(parameter) if "norm" in name
                                else 0.1 * torch.randn_like(parameter))
    head.save_pretrained(folder)
    return Path(folder)
