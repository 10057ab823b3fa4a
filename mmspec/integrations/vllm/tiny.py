"""Tiny checkpoints for testing and benchmarking the vLLM integration on a CPU (main environment).

* :func:`build_tiny_llama`: a random ``LlamaForCausalLM`` with the zoo's word-level tokenizer, saved the way
  vLLM loads it (``PreTrainedTokenizerFast``: the zoo's ``TokenizersBackend`` class name is newer than the
  transformers vLLM pins);
* :func:`build_random_head`: an untrained :class:`~mmspec.models.vlm_drafters.eagle_vlm.EagleVLMHead` sized for
  a target (lossless like any head; its acceptance is low).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mmspec.files import write_json_atomic

from .checkpoints import read_target

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


def build_tiny_llama(folder: str | Path, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                     logit_scale: float = 8.0) -> Path:
    """Save a random Llama (fp32, the zoo tokenizer's vocabulary, heads of width 32) to ``folder``; returns the
    folder. ``hidden_size`` must be a multiple of 32. ``logit_scale`` multiplies the LM head's random weights:
    the default gives greedy text that is not one repeated token, 1 flatter distributions for sampling."""
    if hidden_size % HEAD_DIM:
        raise ValueError(f"hidden_size must be a multiple of {HEAD_DIM}, got {hidden_size}")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    source = _zoo_folder()
    vocab = read_target(source).vocab_size
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=hidden_size // HEAD_DIM, num_key_value_heads=1,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(folder)
    write_fast_tokenizer(source, folder)
    return folder


def build_random_head(target: str | Path, folder: str | Path, seed: int = 0) -> Path:
    """Save an untrained EagleVLMHead sized for ``target`` (its hidden size and vocabulary) to ``folder``."""
    import torch

    from mmspec.models.vlm_drafters.eagle_vlm import EagleVLMHead

    info = read_target(target)
    torch.manual_seed(seed)
    head = EagleVLMHead(hidden_size=info.hidden_size, vocab_size=info.vocab_size,
                        num_attention_heads=max(1, info.hidden_size // HEAD_DIM),
                        max_position_embeddings=512)
    with torch.no_grad():  # non-trivial norms and fc bias, so the export's mapping of each is exercised
        for name, parameter in head.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.copy_(1.0 + 0.1 * torch.randn_like(parameter) if "norm" in name
                                else 0.1 * torch.randn_like(parameter))
    head.save_pretrained(folder)
    return Path(folder)
