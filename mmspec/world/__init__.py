"""The shapes world: mmspec's procedurally generated reference world and its exact evaluator.

Scenes of coloured shapes (:mod:`.scene`), rendered with numpy at 32-256 pixels with a difficulty knob
(:mod:`.render`), captioned from templates (:mod:`.captions`), GenEval-style prompts with structured
metadata (:mod:`.prompts`), videos of moving shapes (:mod:`.video`), torch datasets (:mod:`.datasets`)
and the exact evaluator that parses images back into objects and scores prompts (:mod:`.evaluator`).
See docs/world.md.

Quick tour::

    >>> from mmspec.world import sample_scene, render_scene, parse_image, make_prompt_set, scene_for_prompt
    >>> scene = sample_scene(0)                         # 1-4 random objects
    >>> image = render_scene(scene, image_size=32)      # uint8 [32, 32, 3], difficulty 1
    >>> parse_image(image)                              # [DetectedObject(shape='circle', color='red', ...), ...]
    >>> prompts = make_prompt_set()                     # 600 GenEval-style prompts, 100 per category
    >>> evaluate([render_scene(scene_for_prompt(p, i)) for i, p in enumerate(prompts)], prompts).overall
    1.0
"""

from .captions import (
    DIRECTION_PHRASES,
    DIRECTIONS,
    caption_scene,
    describe_scene,
    qa_kind,
    qa_pairs,
    sample_qa,
    split_words,
    vocabulary,
)
from .datasets import (
    SCENE_CATEGORIES,
    ImageSample,
    ShapesImageDataset,
    ShapesImageStream,
    ShapesVideoDataset,
    ShapesVideoStream,
)
from .evaluator import (
    DetectedObject,
    GenEvalResult,
    VideoEvalResult,
    VideoScore,
    evaluate,
    evaluate_videos,
    is_valid_scene,
    parse_image,
    scene_matches,
    score_image,
    score_video,
)
from .prompts import (
    CATEGORIES,
    EvalPrompt,
    ObjectSpec,
    enumerate_prompts,
    make_prompt_set,
    prompt_satisfied,
    sample_prompt,
    scene_for_prompt,
)
from .render import (
    MAX_DIFFICULTY,
    MAX_IMAGE_SIZE,
    MIN_IMAGE_SIZE,
    render_batch,
    render_scene,
    to_pil,
    to_tensor,
    to_uint8,
)
from .scene import (
    COLORS,
    MARGIN,
    MAX_OBJECTS,
    MIN_GAP,
    RELATIONS,
    SHAPES,
    SIZES,
    Scene,
    WorldObject,
    relations_between,
    rng_for,
    sample_scene,
    scene_from_specs,
)
from .video import (
    MotionSpec,
    VideoClip,
    VideoPrompt,
    caption_video,
    clip_for_prompt,
    clip_in_reading_order,
    make_video_prompt_set,
    narrate_video,
    render_video,
    sample_video,
)

__all__ = [
    "CATEGORIES", "COLORS", "DIRECTIONS", "DIRECTION_PHRASES", "MARGIN", "MAX_DIFFICULTY", "MAX_IMAGE_SIZE",
    "MAX_OBJECTS", "MIN_GAP", "MIN_IMAGE_SIZE", "RELATIONS", "SCENE_CATEGORIES", "SHAPES", "SIZES",
    "DetectedObject", "EvalPrompt", "GenEvalResult", "ImageSample", "MotionSpec", "ObjectSpec", "Scene",
    "ShapesImageDataset", "ShapesImageStream", "ShapesVideoDataset", "ShapesVideoStream", "VideoClip",
    "VideoEvalResult", "VideoPrompt", "VideoScore", "WorldObject",
    "caption_scene", "caption_video", "clip_for_prompt", "clip_in_reading_order", "describe_scene", "enumerate_prompts", "evaluate",
    "is_valid_scene",
    "evaluate_videos", "make_prompt_set", "make_video_prompt_set", "narrate_video", "parse_image",
    "prompt_satisfied", "qa_kind", "qa_pairs", "relations_between", "render_batch", "render_scene", "render_video",
    "rng_for", "sample_prompt", "sample_qa", "sample_scene", "sample_video", "scene_for_prompt",
    "scene_from_specs", "scene_matches", "score_image", "score_video", "split_words", "to_pil", "to_tensor",
    "to_uint8", "vocabulary",
]
