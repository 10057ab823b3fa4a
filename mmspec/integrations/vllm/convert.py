"""Rewrite a transformers-5 LLaVA checkpoint (the zoo's ``shapes-vlm/target``) into the layout vLLM loads.

transformers 5 saves ``LlavaForConditionalGeneration``'s CLIP tower as ``vision_tower.<module>``; vLLM's
LLaVA (like the llava-hf checkpoints) reads ``vision_tower.vision_model.<module>``. The conversion renames
those weights and copies every other file unchanged (config, tokenizer, processor), so the tokenizer
fingerprint an exported head was checked against stays the same. The language model and the projector keep
their names, and no value changes: vLLM serves the same model, images included. The chat template (the
source's, or the processor's passed as ``chat_template``) is written as ``chat_template.jinja`` in the form
vLLM's chat path needs to produce the same prompt tokens (:mod:`.chat`: BOS written by the template).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mmspec.files import atomic_path

from .chat import write_vllm_chat_template
from .checkpoints import CheckpointError, read_target

WEIGHTS = "model.safetensors"
TOWER = "vision_tower."
TOWER_VLLM = "vision_tower.vision_model."


def vllm_weight_name(name: str) -> str:
    """The name vLLM's LLaVA loader expects for one transformers-5 weight name."""
    if name.startswith(TOWER) and not name.startswith(TOWER_VLLM):
        return TOWER_VLLM + name[len(TOWER):]
    return name


def convert_llava_for_vllm(source: str | Path, out: str | Path, chat_template: str | Path | None = None) -> Path:
    """Write ``out``: ``source`` (a single-file LLaVA checkpoint) with vLLM's vision-tower weight names, and its
    chat template (``chat_template``: a template file, e.g. the processor's; default: the one ``source``
    stores, if any) as vLLM should render it.

    Raises:
        CheckpointError (a ValueError): ``source`` is not a LLaVA checkpoint, or has no ``model.safetensors``.
    """
    from safetensors.torch import load_file, save_file

    info = read_target(source, "source")
    if info.architecture != "LlavaForConditionalGeneration":
        raise CheckpointError(f"source: {info.folder} is a {info.architecture}, not a LlavaForConditionalGeneration")
    weights = info.folder / WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"source: {weights} is missing (sharded checkpoints are not converted)")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for path in info.folder.iterdir():
        if path.is_file() and path.name != WEIGHTS:
            shutil.copyfile(path, folder / path.name)
    tensors = {vllm_weight_name(name): tensor for name, tensor in load_file(str(weights)).items()}
    with atomic_path(folder / WEIGHTS) as temporary:
        save_file(tensors, str(temporary), metadata={"format": "pt"})
    write_vllm_chat_template(folder, None if chat_template is None else Path(chat_template).read_text())
    return folder
