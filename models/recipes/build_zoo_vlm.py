"""Assemble the ``mmspec/shapes-vlm`` pipeline folder from the trained parts.

After ``train_vlm`` (target/ and draft/: the captioner and the standalone draft VLM) and
``train_vlm_drafter`` (eagle_head/, flash_head/, vispec_head/, specvlm_head/) have written their parts,
this writes the pipeline layout (``model_index.json``, target/, processor/ with the captioner's chat
template, the heads, draft_model/), so ``VLMPipeline.from_pretrained("mmspec/shapes-vlm")`` works offline
and ``pipe(image, "describe the image in detail.")`` formats the prompt the way the captioner was trained.
Missing heads are left out (their methods are then unavailable); the parts folders are removed once copied.

    python -m mmspec.models.recipes.build_zoo_vlm --folder models/zoo/shapes-vlm
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from mmspec.models.recipes.common import save_zoo_folder

#: the captioner's prompt layout ("user: <image> describe the image in detail. assistant:") as a chat
#: template, so that plain-text prompts are formatted like the training prompts
SHAPES_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}user: "
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>{% endif %}{% endfor %} "
    "{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}"
    " assistant:{% endif %}{% endfor %}"
)
HEADS = ("eagle_head", "flash_head", "vispec_head", "specvlm_head")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, default=Path("models/zoo/shapes-vlm"))
    args = parser.parse_args(argv)
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmspec.models.vlm_drafters import EagleVLMHead, FlashHead, SpecVLMHead, ViSpecHead
    from mmspec.pipelines import VLMPipeline

    folder = args.folder
    if not (folder / "target" / "config.json").is_file():
        raise SystemExit(f"{folder}/target holds no trained captioner: run models.recipes.train_vlm first")
    half = torch.float16  # the recipes save every part in fp16; the pipeline computes in fp32
    processor = AutoProcessor.from_pretrained(folder / "target")
    processor.chat_template = SHAPES_CHAT_TEMPLATE
    classes = {"eagle_head": EagleVLMHead, "flash_head": FlashHead, "vispec_head": ViSpecHead,
               "specvlm_head": SpecVLMHead}
    heads = {name: classes[name].from_pretrained(folder / name, torch_dtype=half)  # diffusers loads fp32 otherwise
             for name in HEADS if (folder / name).is_dir()}
    draft_dir = folder / ("draft" if (folder / "draft").is_dir() else "draft_model")
    draft = LlavaForConditionalGeneration.from_pretrained(draft_dir, dtype=half) if draft_dir.is_dir() else None
    target = LlavaForConditionalGeneration.from_pretrained(folder / "target", dtype=half)
    pipe = VLMPipeline(target=target, processor=processor, draft_model=draft, **heads)
    staging = folder.with_name(folder.name + ".staging")
    save_zoo_folder(pipe, staging)
    # keep the files save_pretrained does not write (processor and tokenizer files, training reports) beside
    # the parts; the draft comes from draft/ (fresh from the recipe) or draft_model/ (a rebuilt folder)
    for source, name in ((folder / "target", "target"), (draft_dir, "draft_model")):
        if not (staging / name).is_dir():  # no draft model
            continue
        for extra in source.glob("*.json"):
            if not (staging / name / extra.name).exists():
                shutil.copy(extra, staging / name / extra.name)
    for item in folder.iterdir():
        if item.is_file() and not (staging / item.name).exists():
            shutil.copy(item, staging / item.name)
    shutil.rmtree(folder)
    staging.rename(folder)
    print(f"wrote {folder} ({', '.join(['target', 'processor', *heads] + (['draft_model'] if draft else []))})")


if __name__ == "__main__":
    main()
