"""Prompts read the same whatever their casing: the zoo's vocabularies are lower case, and every pipeline's
tokenizer lowercases first (the VLM's fast tokenizer has a Lowercase normalizer; the image and video
pipelines' word vocabulary splits lowercased words)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_vlm_answers_a_capitalised_prompt_as_the_lower_case_one():
    from mmspec.pipelines import VLMPipeline
    from mmspec.world import render_scene, sample_scene

    pipe = VLMPipeline.from_pretrained("mmspec/shapes-vlm")
    pipe.set_progress_bar_config(disable=True)
    image = render_scene(sample_scene(0), image_size=64)
    lower = pipe(image, "describe the image in detail.", max_new_tokens=24)
    upper = pipe(image, "Describe The Image In Detail.", max_new_tokens=24)
    assert upper.text == lower.text and torch.equal(upper.tokens[0], lower.tokens[0])
    assert pipe.tokenizer("Describe")["input_ids"] == pipe.tokenizer("describe")["input_ids"]


@pytest.mark.parametrize("name, zoo_id, prompt", [
    ("ARImagePipeline", "mmspec/shapes-t2i", "A Red Circle"),
    ("ContinuousARImagePipeline", "mmspec/shapes-t2i-continuous", "Two Blue Squares"),
    ("ARVideoPipeline", "mmspec/shapes-video", "A Red Circle Moving Right"),
])
def test_image_and_video_pipelines_encode_capitalised_prompts_as_lower_case(name, zoo_id, prompt):
    import mmspec.pipelines

    pipe = getattr(mmspec.pipelines, name).from_pretrained(zoo_id)
    assert pipe.text_tokenizer.encode(prompt) == pipe.text_tokenizer.encode(prompt.lower())
