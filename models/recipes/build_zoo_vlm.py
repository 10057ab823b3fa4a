"""Assemble the ``mmspec/shapes-vlm`` pipeline folder from the trained parts.

After ``train_vlm`` (target/ and draft/: the captioner and the standalone draft VLM) and
``train_vlm_drafter`` (eagle_head/, flash_head/, vispec_head/, specvlm_head/) have written their parts,
this writes the pipeline layout (``model_index.json``, target/, processor/ with the captioner's chat
template, the heads, draft_model/) and the methods' recommended settings (``speculation_config.json``,
:data:`SPECULATION_SETTINGS`), so ``VLMPipeline.from_pretrained("mmspec/shapes-vlm")`` works offline,
``pipe(image, "describe the image in detail.")`` formats the prompt the way the captioner was trained and
``pipe(..., method="flash")`` runs with the settings the benchmark measured. Missing heads are left out
(their methods are then unavailable); the parts folders are removed once copied.

    python -m mmspec.models.recipes.build_zoo_vlm --folder models/zoo/shapes-vlm
    python -m mmspec.models.recipes.build_zoo_vlm --folder models/zoo/shapes-vlm --settings-only  # the table alone
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

#: The zoo's recommended settings per method (``speculation_config.json``), measured with
#: ``python -m mmspec.evaluation.bench_vlm --threads 1 --repeats 5`` (docs/pipeline_vlm.md, "Speed on the
#: zoo"): the heads are accepted so often that long chains pay, K = 10 (FLASH: two semi-autoregressive
#: forwards of its 5 drafts); K = 6 accepted less and K = 12 verified more for little gain; an EAGLE-2 tree
#: was slower than the chain and a confidence cut-off gained a few per cent at most, so neither is stored.
#: The standalone draft VLM costs more per draft: K = 8. The same in every decoding mode and batch size (the
#: benchmark measured these for temperature 0 and 1, batch 1 and 4), except at batch 1, re-measured on an idle
#: machine (2026-12-08, image descriptions, one thread, ``--method-kwargs`` variants): FLASH drafts three
#: semi-autoregressive forwards, K = 15 (4.50x against 3.79x with 10; 20 gained nothing more), and the draft VLM
#: chains of up to 10 cut at confidence 0.5 (2.45x against 2.25x). Every VLM method is lossless, so no setting
#: here trades quality.
SPECULATION_SETTINGS: dict[str, dict] = {
    "eagle": {"settings": {"num_draft_tokens": 10}},
    "flash": {"settings": {"num_draft_tokens": 10},
              "variants": [{"when": {"batch_size": 1}, "settings": {"num_draft_tokens": 15}}]},
    "vispec": {"settings": {"num_draft_tokens": 10}},
    "specvlm": {"settings": {"num_draft_tokens": 10}},
    "draft_vlm": {"settings": {"num_draft_tokens": 8},
                  "variants": [{"when": {"batch_size": 1},
                                "settings": {"num_draft_tokens": 10, "draft_confidence_threshold": 0.5}}]},
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, default=Path("models/zoo/shapes-vlm"))
    parser.add_argument("--settings-only", action="store_true",
                        help="write only speculation_config.json into an assembled folder")
    args = parser.parse_args(argv)
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmspec.methods import SpeculationSettings
    from mmspec.models.vlm_drafters import EagleVLMHead, FlashHead, SpecVLMHead, ViSpecHead
    from mmspec.pipelines import VLMPipeline

    folder = args.folder
    if args.settings_only:
        if not (folder / "model_index.json").is_file():
            raise SystemExit(f"{folder} is not an assembled pipeline folder: run without --settings-only first")
        print(f"wrote {SpeculationSettings.from_dict('vlm', SPECULATION_SETTINGS).save(folder)}")
        return
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
    pipe.set_speculation_settings(SPECULATION_SETTINGS)  # save_pretrained writes speculation_config.json
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
