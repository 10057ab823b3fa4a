"""Export an mmspec EAGLE-style draft head to a folder vLLM's EAGLE path loads.

vLLM's own EAGLE-1 head (``EagleLlamaForCausalLM``) computes ``layer(fc([embed(x) ; h]))`` with a bias-free
fc, no input RMSNorm in its first layer and no final norm, and feeds the un-normalised output back. mmspec's
heads (:class:`~mmspec.models.eagle.EagleHead` and the VLM heads built on it) differ in four places: the fc
has a bias, the decoder layer keeps its input RMSNorm, a final RMSNorm produces the predicted feature (which
is both what the LM head reads and what is fed back), and EagleVLM / SpecVLM RMS-normalise ``[embed ; h]``
before the fc. None of these folds into the others' weights (an RMSNorm rescales each vector by its own
norm), so there is no exact export to ``EagleLlamaForCausalLM``. The export therefore targets
``EagleMmspecHeadForCausalLM``, which mmspec's vLLM plugin registers (:mod:`.model`): the same Llama layer
as vLLM's, plus exactly those four pieces, with the weights mapped one to one.

What each head class becomes (``visual``):

* ``EagleHead`` (text targets) and ``EagleVLMHead``: exact. EagleVLM's view of an image is every image token
  with the embedding the target read there, which vLLM hands to EAGLE heads that accept multimodal
  embeddings; the exported head does.
* ``ViSpecHead`` / ``SpecVLMHead``: their visual modules (ViSpec's adaptor and global fusion, SpecVLM's
  elastic compressor and gate) have no hook in vLLM's proposer, which feeds the draft one unit per target
  token. ``visual="text"`` exports their EAGLE core: exact on prompts without images; at image tokens the
  head then reads the placeholder token's embedding (still lossless: the target verifies every draft).
* ``FlashHead``: not exportable. Its readout proposes K tokens per forward and compresses images to
  latents; vLLM's EAGLE proposer runs one forward per draft token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmspec.files import atomic_path, write_json_atomic

from .checkpoints import (
    EXPORT_FORMAT,
    EXPORTED_ARCHITECTURE,
    CheckpointError,
    HeadInfo,
    check_head_fits_target,
    read_head,
    read_target,
)

#: head classes -> (prefix of the EAGLE core's weights, visual modes the export supports)
HEAD_CLASSES: dict[str, tuple[str, tuple[str, ...]]] = {
    "EagleHead": ("", ("auto", "text")),
    "EagleVLMHead": ("head.", ("auto", "text")),
    "ViSpecHead": ("head.", ("text",)),
    "SpecVLMHead": ("head.", ("text",)),
}
WHY_NOT = {
    "FlashHead": "FLASH proposes K tokens per forward (its future readout) and compresses images to latents; "
                 "vLLM's EAGLE proposer runs one head forward per draft token and has no image-compression hook",
    "ViSpecHead": "ViSpec's vision adaptor and global-vector fusion have no hook in vLLM's EAGLE proposer",
    "SpecVLMHead": "SpecVLM's elastic compressor and its gate have no hook in vLLM's EAGLE proposer",
}
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ExportOptions:
    """How :func:`export_head` writes a head.

    Attributes:
        visual: ``"auto"``: the head's own view of images (exact: plain EAGLE and EagleVLM heads only);
            ``"text"``: the EAGLE core only, image placeholders read as tokens (ViSpec, SpecVLM).
        dtype: weights' dtype in the exported file (``"float32"``, ``"float16"``, ``"bfloat16"``), or None to
            keep the head's.
        num_speculative_tokens: the draft length the export suggests (``mmspec.num_speculative_tokens`` in its
            config; :func:`mmspec.integrations.vllm.launch.speculative_config` uses it by default), 1 to 64.
    """

    visual: str = "auto"
    dtype: str | None = None
    num_speculative_tokens: int = 4

    def __post_init__(self) -> None:
        if self.visual not in ("auto", "text"):
            raise ValueError(f"visual must be 'auto' or 'text', got {self.visual!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES} or None, got {self.dtype!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 64:
            raise ValueError(f"num_speculative_tokens must be an int in [1, 64], got {k!r}")


def _core_prefix(head: HeadInfo, options: ExportOptions) -> str:
    name = head.class_name
    if name not in HEAD_CLASSES:
        reason = WHY_NOT.get(name, "only EagleHead, EagleVLMHead, ViSpecHead and SpecVLMHead are exportable")
        raise CheckpointError(f"head: {name} cannot be exported to vLLM: {reason}")
    prefix, modes = HEAD_CLASSES[name]
    if options.visual not in modes:
        raise CheckpointError(f"head: {WHY_NOT[name]}; export its EAGLE core with visual='text' (exact on prompts "
                              "without images, lossless on all)")
    if head.config.get("num_future", 1) != 1:
        raise CheckpointError(f"head: {name} has num_future={head.config['num_future']}: {WHY_NOT['FlashHead']}")
    if head.config.get("feature_guidance") is not None:
        raise CheckpointError("head: feature_guidance (classifier-free guidance on features) has no vLLM counterpart")
    return prefix


def exported_name(name: str, prefix: str) -> str | None:
    """The exported name of one head weight (None: not part of the EAGLE core)."""
    if not name.startswith(prefix):
        return None
    name = name[len(prefix):]
    if name.startswith(("fc.", "fused_norm.")):
        return name
    if name.startswith("decoder."):
        return name[len("decoder."):]  # layers.0.* and norm.weight: vLLM's Llama layer names
    return None


def exported_config(head: HeadInfo, options: ExportOptions, weights: dict[str, Any], target: Any) -> dict[str, Any]:
    """config.json of the exported folder: a Llama config of one layer plus the ``mmspec`` section the vLLM
    model class reads (which pieces are present, and the target the head was checked against)."""
    cfg = head.config
    hidden, heads = cfg["hidden_size"], cfg.get("num_attention_heads", 4)
    return {
        "architectures": [EXPORTED_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": cfg.get("intermediate_size") or 4 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": hidden // heads,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.get("norm_eps", 1e-6),
        "max_position_embeddings": cfg.get("max_position_embeddings", 4096),
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)},
        "vocab_size": cfg["vocab_size"],
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "dtype": options.dtype or _dtype_name(next(iter(weights.values())).dtype),
        "mmspec": {
            "format": EXPORT_FORMAT,
            "head_class": head.class_name,
            "input_norm": "fused_norm.weight" in weights,
            "fc_bias": "fc.bias" in weights,
            "multimodal_embeddings": options.visual == "auto" and head.class_name != "EagleHead",
            "num_speculative_tokens": options.num_speculative_tokens,
            "target": {"architecture": target.architecture, "hidden_size": target.hidden_size,
                       "vocab_size": target.vocab_size, "tokenizer": target.tokenizer},
        },
    }


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def export_head(head: str | Path, target: str | Path, out: str | Path,
                options: ExportOptions = ExportOptions()) -> Path:
    """Write ``out`` (``config.json`` + ``model.safetensors``): ``head`` as vLLM's EAGLE path loads it with
    mmspec's plugin installed. Serve it with ``speculative_config={"method": "eagle", "model": out}``.

    Args:
        head: an mmspec head folder (``save_pretrained``).
        target: the target checkpoint the head drafts for; its hidden size, vocabulary size and tokenizer are
            checked against the head and recorded in the export (checked again before serving).
        out: the folder to write (created; files in it are replaced).
        options: :class:`ExportOptions`.
    Raises:
        CheckpointError (a ValueError): a missing folder or file, a head trained for another target, a head
            class or option vLLM cannot express (the message says why).
    """
    import torch
    from safetensors.torch import load_file, save_file

    if not isinstance(options, ExportOptions):
        raise ValueError(f"options must be an ExportOptions, got {type(options).__name__}")
    info = read_head(head)
    target_info = read_target(target)
    check_head_fits_target(info.config["hidden_size"], info.config["vocab_size"], None, target_info,
                           who=f"the {info.class_name} in {info.folder}")
    prefix = _core_prefix(info, options)
    try:
        weights = load_file(str(info.weights))
    except Exception as error:  # safetensors raises its own error type for a file that is not one
        raise CheckpointError(f"head: {info.weights} is not a readable safetensors file ({error})") from error
    renamed = {name: exported_name(name, prefix) for name in weights}
    unknown = [name for name, new_name in renamed.items() if new_name is None]
    if unknown and options.visual == "auto":
        raise CheckpointError(f"head: {info.class_name} has weights outside its EAGLE core ({unknown[:3]}...), which "
                              "the export would drop; pass visual='text' if that is intended")
    tensors = {new_name: weights[name] for name, new_name in renamed.items() if new_name is not None}
    if "fc.weight" not in tensors or "norm.weight" not in tensors:
        raise CheckpointError(f"head: {info.weights} has no EAGLE core (fc / decoder weights)")
    if options.dtype is not None:
        dtype = getattr(torch, options.dtype)
        tensors = {name: tensor.to(dtype) for name, tensor in tensors.items()}
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / "model.safetensors") as temporary:
        save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(temporary),
                  metadata={"format": "pt"})
    write_json_atomic(folder / "config.json", exported_config(info, options, tensors, target_info))
    return folder
