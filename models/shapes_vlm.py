"""The shapes-world captioner of the ``mmspec/shapes-vlm`` zoo entry, as real transformers classes.

The target and its standalone draft are ``LlavaForConditionalGeneration`` models (a small CLIP vision
tower, a two-layer projector, a Llama text model), and the processor is a ``LlavaProcessor`` over a
word-level ``PreTrainedTokenizerFast`` and a PIL-only ``CLIPImageProcessorPil`` (no torchvision). So the
same adapter path that serves real LLaVA checkpoints (``VLMRunner``, ``AutoProcessor``,
``model.generate`` with ``assistant_model=``) serves the zoo model unchanged.

Tasks (prompt -> answer, every answer exactly determined by the scene or clip):

=================  ================================================  =====================================
task               prompt text after the images                       answer
=================  ================================================  =====================================
``describe``       "describe the image in detail."                    ``describe_scene`` (38-216 words)
``caption``        "caption the image."                               ``caption_scene``
``qa``             a ``sample_qa`` question ("how many ... ?")        one or two words
``narrate``        "narrate the video."  (several frames)             ``narrate_video`` (40-110 words)
``video_caption``  "caption the video."  (several frames)             ``caption_video``
=================  ================================================  =====================================

A prompt is ``"user: <image> describe the image in detail. assistant:"`` (LLaVA-1.5's layout, lower
case); a video is a sequence of frames, one ``<image>`` per frame (``"user: <image><image><image><image>
narrate the video. assistant:"``). The processor expands each ``<image>`` into ``IMAGE_TOKENS`` (64)
placeholders, so a 64x64 image costs 64 prefill tokens against 60-200 answer tokens.

Build a batch (left padding for generation)::

    processor = load_processor(folder)            # or AutoProcessor.from_pretrained(folder)
    inputs = vlm_inputs(processor, [image_a, image_b], ["describe", "describe"])      # images: uint8 HxWx3 / PIL
    inputs = vlm_inputs(processor, [frames], ["narrate"])                             # frames: [T, H, W, 3]
    out = model.generate(**inputs, max_new_tokens=256, do_sample=False)
    texts = decode_answers(processor, out, inputs["input_ids"].shape[1])

Training data comes from :func:`build_training_set`; its batches and the answer loss live with the recipes
(:mod:`mmspec.models.recipes.vlm_answer_loss`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from mmspec.validation import check_positive_int
from mmspec.world import (
    caption_scene,
    caption_video,
    clip_in_reading_order,
    describe_scene,
    narrate_video,
    render_scene,
    render_video,
    sample_qa,
    sample_scene,
    sample_video,
    vocabulary,
)
from mmspec.world.parallel import build_in_parts, concat_parts
from mmspec.world.scene import COLORS, MAX_OBJECTS, NAMESPACES, SHAPES, SIZES, Scene, rng_for
from mmspec.world.video import VideoClip

PAD, BOS, EOS, UNK, IMAGE = "<pad>", "<s>", "</s>", "<unk>", "<image>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK, IMAGE)  # ids 0-4, in this order
PROMPT_WORDS: tuple[str, ...] = ("user", "assistant", ":", "describe", "detail", "caption", "narrate")

IMAGE_SIZE = 64
PATCH_SIZE = 8
GRID = IMAGE_SIZE // PATCH_SIZE  # 8 x 8 patches
IMAGE_TOKENS = GRID * GRID  # 64 placeholders per image (CLS dropped)
VIDEO_FRAMES = 4
DIFFICULTY = 1.0
VIDEO_SALT = 7  # keeps clip streams apart from scene streams
CLEARANCE = 1 / 64  # one pixel at 64x64: see scene_clearance
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)

TASKS: tuple[str, ...] = ("describe", "caption", "qa", "narrate", "video_caption")
VIDEO_TASKS: tuple[str, ...] = ("narrate", "video_caption")
INSTRUCTIONS: dict[str, str] = {
    "describe": "describe the image in detail.",
    "caption": "caption the image.",
    "narrate": "narrate the video.",
    "video_caption": "caption the video.",
}

# Model sizes. The target is deep and narrow (DESIGN section 4: a CPU forward costs ~0.5 ms per layer
# almost regardless of width up to d=256, so depth sets the decode cost and width mostly the training
# cost); the draft is a quarter of its depth with a smaller vision tower.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "target": dict(text_layers=8, text_dim=128, text_heads=4, text_ffn=512,
                   vision_layers=4, vision_dim=128, vision_heads=4, vision_ffn=384),
    "draft": dict(text_layers=2, text_dim=128, text_heads=2, text_ffn=384,
                  vision_layers=2, vision_dim=96, vision_heads=2, vision_ffn=288),
    "tiny": dict(text_layers=2, text_dim=32, text_heads=4, text_ffn=64,
                 vision_layers=1, vision_dim=32, vision_heads=2, vision_ffn=64),
}
MAX_POSITIONS = 1024  # 8 frames x 64 + a 200-word narration still fit


# ----------------------------------------------------------------------------------------------------
# tokenizer, image processor, processor
# ----------------------------------------------------------------------------------------------------


def tokenizer_words() -> list[str]:
    """The word list after the special tokens: the world's vocabulary plus the prompt words (sorted)."""
    return sorted(set(vocabulary()) | set(PROMPT_WORDS))


def build_tokenizer():
    """A word-level ``PreTrainedTokenizerFast``: specials ``<pad> <s> </s> <unk> <image>`` (ids 0-4), then
    every word of :func:`tokenizer_words`. Text is lowercased first (the world's words are lower case, so
    "Describe the image." reads as "describe the image."); words split on spaces and punctuation (",", ".",
    "?", ":" are tokens of their own); ``<s>`` is prepended; decoding re-attaches punctuation, so
    ``decode(encode(text))`` gives back any text of the world exactly."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + tokenizer_words())}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated")])
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    # WordPiece's decoder joins words with spaces and its clean-up removes the space before . , ? (and
    # nothing else the world's vocabulary contains); "##" never occurs.
    core.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                        unk_token=UNK, extra_special_tokens={"image_token": IMAGE},
                                        padding_side="left", clean_up_tokenization_spaces=False)
    return tokenizer


def build_image_processor():
    """A PIL-backend CLIP image processor for 64x64 RGB inputs: resize to 64x64 (bicubic; a no-op for
    the world's 64x64 renders), scale to [0, 1], normalise with mean = std = 0.5."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_center_crop=False,
                                 crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                 image_mean=list(IMAGE_MEAN), image_std=list(IMAGE_STD))


# The training layout as a chat template, so that ``processor.apply_chat_template`` (and the VLM pipeline's
# prompt formatting) gives exactly :func:`task_prompt`'s text: images first, then the text, then
# " assistant:". Earlier assistant turns end with </s>.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set texts = [message['content']] -%}{%- set images = 0 -%}"
    "{%- else -%}"
    "{%- set texts = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | list -%}"
    "{%- set images = message['content'] | selectattr('type', 'in', ['image', 'video']) | list | length -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}"
    "{%- if not loop.first %} {% endif -%}user: {{ '<image>' * images }}{% if images %} {% endif %}{{ texts | join(' ') }}"
    "{%- else %} assistant: {{ texts | join(' ') }}</s>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %} assistant:{% endif -%}"
)


def build_processor():
    """The ``LlavaProcessor`` of the shapes VLM (tokenizer + image processor; 64 placeholders per image;
    a chat template that writes the training prompt layout)."""
    from transformers import LlavaProcessor

    return LlavaProcessor(image_processor=build_image_processor(), tokenizer=build_tokenizer(),
                          patch_size=PATCH_SIZE, vision_feature_select_strategy="default",
                          num_additional_image_tokens=1, image_token=IMAGE, chat_template=CHAT_TEMPLATE)


def load_processor(folder: str | Path):
    """``AutoProcessor.from_pretrained(folder)`` offline, with left padding for generation."""
    from transformers import AutoProcessor

    folder = Path(folder)
    if not (folder / "processor_config.json").is_file() and not (folder / "preprocessor_config.json").is_file():
        raise FileNotFoundError(f"no processor files in {folder}")
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True, backend="pil")  # = training pixels
    processor.tokenizer.padding_side = "left"
    return processor


# ----------------------------------------------------------------------------------------------------
# config and model
# ----------------------------------------------------------------------------------------------------


def shapes_vlm_config(size: str = "target", **overrides):
    """The ``LlavaConfig`` of a shapes VLM: ``size`` is "target" (8-layer d=128 Llama, 4-layer d=128 CLIP
    tower), "draft" (2-layer d=128 Llama, 2-layer d=96 tower) or "tiny" (tests). ``overrides`` replace
    entries of :data:`MODEL_SIZES`. Token ids are the fixed ids of :func:`build_tokenizer`."""
    from transformers import LlavaConfig

    if size not in MODEL_SIZES:
        raise ValueError(f"size must be one of {list(MODEL_SIZES)}, got {size!r}")
    unknown = set(overrides) - set(MODEL_SIZES[size])
    if unknown:
        raise ValueError(f"unknown size overrides {sorted(unknown)}; allowed: {sorted(MODEL_SIZES[size])}")
    s = {**MODEL_SIZES[size], **overrides}
    ids = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab_size = len(SPECIAL_TOKENS) + len(tokenizer_words())
    vision = dict(model_type="clip_vision_model", hidden_size=s["vision_dim"], intermediate_size=s["vision_ffn"],
                  num_hidden_layers=s["vision_layers"], num_attention_heads=s["vision_heads"],
                  image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=s["vision_dim"])
    text = dict(model_type="llama", vocab_size=vocab_size, hidden_size=s["text_dim"],
                intermediate_size=s["text_ffn"], num_hidden_layers=s["text_layers"],
                num_attention_heads=s["text_heads"], num_key_value_heads=s["text_heads"],
                max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False, pad_token_id=ids[PAD],
                bos_token_id=ids[BOS], eos_token_id=ids[EOS])
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=ids[IMAGE],
                       image_seq_length=IMAGE_TOKENS, vision_feature_layer=-1,
                       vision_feature_select_strategy="default", projector_hidden_act="gelu",
                       tie_word_embeddings=False, pad_token_id=ids[PAD], bos_token_id=ids[BOS],
                       eos_token_id=ids[EOS])


def sincos_positions(dim: int, grid: int = GRID, amplitude: float = 0.5) -> torch.Tensor:
    """``[1 + grid * grid, dim]`` 2-D sine-cosine position table (row 0, the CLS slot, is zero): the first
    half of the channels encodes the patch column, the second half the row, at ``dim / 4`` frequencies each.

    Used to initialise the CLIP tower's learned position embeddings: from the default N(0, 0.02) start the
    tower learned where patches are only after hundreds of steps (a probe read each object's region no
    better than chance at step 250), and every region word and relation of a description depends on it.
    """
    if dim % 4:
        raise ValueError(f"dim must be a multiple of 4, got {dim}")
    freqs = 1.0 / (grid ** (torch.arange(dim // 4, dtype=torch.float64) / (dim // 4)))  # [dim/4]
    coords = torch.arange(grid, dtype=torch.float64)
    angles = coords[:, None] * freqs[None, :] * torch.pi / 2  # [grid, dim/4]
    axis = torch.cat([angles.sin(), angles.cos()], dim=1)  # [grid, dim/2]
    cols = axis[None, :, :].expand(grid, grid, -1)  # [row, col, dim/2]
    rows = axis[:, None, :].expand(grid, grid, -1)
    table = torch.cat([cols, rows], dim=-1).reshape(grid * grid, dim)
    return torch.cat([torch.zeros(1, dim, dtype=torch.float64), table]).float() * amplitude


def build_model(size: str = "target", seed: int = 0, **overrides):
    """A randomly initialised ``LlavaForConditionalGeneration`` of :func:`shapes_vlm_config` (fp32; the vision
    tower's position embeddings start from :func:`sincos_positions`), with its generation config set to stop
    at ``</s>`` and pad with ``<pad>``."""
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(shapes_vlm_config(size, **overrides))
    embeddings = model.model.vision_tower.embeddings
    with torch.no_grad():  # an initialisation only: the tower stays a plain CLIP with learned positions
        embeddings.position_embedding.weight.copy_(sincos_positions(embeddings.position_embedding.weight.shape[1]))
    ids = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    model.generation_config.eos_token_id = ids[EOS]
    model.generation_config.pad_token_id = ids[PAD]
    model.generation_config.bos_token_id = ids[BOS]
    return model


def load_model(folder: str | Path, dtype: torch.dtype = torch.float32):
    """``LlavaForConditionalGeneration.from_pretrained(folder)`` offline (the zoo stores fp16; computing
    in fp32 is the default), in eval mode."""
    from transformers import LlavaForConditionalGeneration

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no model config.json in {folder}")
    return LlavaForConditionalGeneration.from_pretrained(folder, dtype=dtype, local_files_only=True).eval()


# ----------------------------------------------------------------------------------------------------
# prompts and batches
# ----------------------------------------------------------------------------------------------------


def task_prompt(task: str, question: str | None = None, num_frames: int = VIDEO_FRAMES) -> str:
    """The prompt text of a task: ``"user: <image> describe the image in detail. assistant:"``; video
    tasks carry one ``<image>`` per frame; ``task="qa"`` needs ``question``."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {list(TASKS)}, got {task!r}")
    if task == "qa":
        if not isinstance(question, str) or not question.strip():
            raise ValueError("task 'qa' needs a question string")
        instruction = question.strip()
    else:
        if question is not None:
            raise ValueError(f"task {task!r} takes no question")
        instruction = INSTRUCTIONS[task]
    if task in VIDEO_TASKS:
        if not isinstance(num_frames, int) or num_frames < 1:
            raise ValueError(f"num_frames must be a positive integer, got {num_frames!r}")
        images = IMAGE * num_frames
    else:
        images = IMAGE
    return f"user: {images} {instruction} assistant:"


def _as_frames(visual, task: str) -> list[np.ndarray]:
    """One task's visual input as a list of uint8 [H, W, 3] frames."""
    if isinstance(visual, Image.Image):
        visual = np.asarray(visual.convert("RGB"))
    if isinstance(visual, torch.Tensor):
        visual = visual.detach().cpu()
        if visual.is_floating_point():
            visual = (visual.clamp(0, 1) * 255).round().to(torch.uint8)
        visual = visual.numpy()
        if visual.ndim >= 3 and visual.shape[-3] == 3 and visual.shape[-1] != 3:  # [..., 3, H, W]
            visual = np.moveaxis(visual, -3, -1)
    if isinstance(visual, (list, tuple)):
        frames = [f for v in visual for f in _as_frames(v, "describe")]
    else:
        visual = np.asarray(visual)
        if visual.ndim == 3 and visual.shape[-1] == 3:
            frames = [visual]
        elif visual.ndim == 4 and visual.shape[-1] == 3:
            frames = list(visual)
        else:
            raise ValueError(f"an image must be [H, W, 3] (or a video [T, H, W, 3]), got shape {visual.shape}")
    if task not in VIDEO_TASKS and len(frames) != 1:
        raise ValueError(f"task {task!r} takes one image, got {len(frames)} frames")
    return [f if f.dtype == np.uint8 else (np.clip(f, 0, 1) * 255).round().astype(np.uint8) for f in frames]


def vlm_inputs(processor, visuals: Sequence, tasks: Sequence[str], questions: Sequence[str | None] | None = None,
               return_tensors: str = "pt") -> dict:
    """A left-padded generation batch: ``input_ids``, ``attention_mask``, ``pixel_values [N_images, 3, 64, 64]``.

    ``visuals[b]`` is row b's image (uint8 / float numpy ``[H, W, 3]``, a float tensor ``[3, H, W]``, a PIL
    image) or, for video tasks, its frames (``[T, H, W, 3]`` or a list of images); ``tasks[b]`` one of
    :data:`TASKS`; ``questions[b]`` the question of a "qa" row. ``pixel_values`` hold every row's frames
    in row order, as LLaVA expects.
    """
    if len(visuals) != len(tasks):
        raise ValueError(f"visuals and tasks must have the same length, got {len(visuals)} and {len(tasks)}")
    if questions is None:
        questions = [None] * len(tasks)
    if len(questions) != len(tasks):
        raise ValueError(f"questions must have one entry per row, got {len(questions)} for {len(tasks)} rows")
    texts, images = [], []
    for visual, task, question in zip(visuals, tasks, questions):
        frames = _as_frames(visual, task)
        texts.append(task_prompt(task, question, len(frames)))
        images += [Image.fromarray(f) for f in frames]
    processor.tokenizer.padding_side = "left"
    return dict(processor(images=images, text=texts, padding=True, return_tensors=return_tensors))


def decode_answers(processor, sequences: torch.Tensor, prompt_length: int) -> list[str]:
    """The answer texts of generated ``sequences [B, prompt_length + new]`` (specials dropped)."""
    return processor.tokenizer.batch_decode(sequences[:, prompt_length:], skip_special_tokens=True)


def pixel_values_from_uint8(frames: torch.Tensor) -> torch.Tensor:
    """``[N, H, W, 3]`` uint8 (64x64 renders) -> normalised ``[N, 3, H, W]`` float32, equal to what the
    processor gives for the same images (tested); the training recipe's fast path."""
    if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 [N, H, W, 3], got {frames.dtype} {tuple(frames.shape)}")
    x = (frames.permute(0, 3, 1, 2).double() * (1 / 255)).float()  # the processor rescales in float64
    mean = torch.tensor(IMAGE_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGE_STD).view(1, 3, 1, 1)
    return (x - mean) / std


# ----------------------------------------------------------------------------------------------------
# examples from the world
# ----------------------------------------------------------------------------------------------------


def scene_clearance(scene: Scene) -> float:
    """How far (canvas fractions) every object centre can move, along each axis, without changing
    ``describe_scene``: the distance of each centre coordinate from the region edges 1/3 and 2/3, and for
    each pair a quarter of ``| |dx| - |dy| |`` (the dominant-relation test; moving both centres by t changes
    that difference by at most 4t) and, for a pair in the same region row, half of ``|dx|`` (the listing
    order, ``reading_order``, sorts such a pair by x). Colours, shapes, sizes and counts are discrete and
    never ambiguous."""
    clearance = 1.0
    for o in scene.objects:
        for v in (o.x, o.y):
            clearance = min(clearance, abs(v - 1 / 3), abs(v - 2 / 3))
    objs = scene.objects
    for i in range(len(objs)):
        for j in range(i + 1, len(objs)):
            dx, dy = objs[i].x - objs[j].x, objs[i].y - objs[j].y
            clearance = min(clearance, abs(abs(dx) - abs(dy)) / 4)
            if _region_row(objs[i].y) == _region_row(objs[j].y):
                clearance = min(clearance, abs(dx) / 2)
    return clearance


def _region_row(y: float) -> int:
    """The 3x3 grid row of a centre's y (the first key of ``reading_order``)."""
    return int(min(y * 3, 2.999))


def clip_clearance(clip: VideoClip) -> float:
    """:func:`scene_clearance` of a clip's first and last frames (what ``narrate_video`` reads)."""
    return min(scene_clearance(clip.scene_at(0)), scene_clearance(clip.scene_at(clip.num_frames - 1)))


def _check_clearance(clearance: float) -> float:
    if not isinstance(clearance, (int, float)) or not 0 <= clearance < 1 / 12:
        raise ValueError(f"clearance must be a number in [0, 1/12), got {clearance!r}")
    return float(clearance)


def sample_clear_scene(rng: np.random.Generator, clearance: float = CLEARANCE, max_tries: int = 10000) -> Scene:
    """A ``sample_scene`` of 1-4 objects (count uniform, drawn first) redrawn until
    :func:`scene_clearance` >= ``clearance``: its description is then the same for every render in
    which no centre is off by more than ``clearance`` (1 pixel at 64x64 by default)."""
    clearance = _check_clearance(clearance)
    num_objects = int(rng.integers(1, MAX_OBJECTS + 1))
    for _ in range(max_tries):
        scene = sample_scene(rng, num_objects=num_objects)
        if scene_clearance(scene) >= clearance:
            return scene
    raise RuntimeError(f"no scene of {num_objects} objects with clearance {clearance} in {max_tries} draws")


def has_shared_colour(scene: Scene) -> bool:
    """Whether two objects share a colour: the description then says so ("two of the shapes are red")."""
    colors = [o.color for o in scene.objects]
    return len(set(colors)) < len(colors)


def has_twins(scene: Scene) -> bool:
    """Whether two objects share shape and colour: their names in the relations then need the size (and,
    for equal sizes, the region) to be unambiguous (``referring_names``)."""
    kinds = [(o.shape, o.color) for o in scene.objects]
    return len(set(kinds)) < len(kinds)


def sample_duplicate_scene(rng: np.random.Generator, twins: bool, clearance: float = CLEARANCE,
                           max_tries: int = 10000) -> Scene:
    """A :func:`sample_clear_scene` redrawn until two objects share a colour (``twins``: and a shape).

    Such scenes carry the description's hardest sentences, the ones a caption can only get right by
    comparing the objects it has listed: the shared-colour sentence and the size- or region-qualified
    names of look-alike objects. They are about a quarter (shared colour) and a twentieth (twins) of
    the world's scenes; training mixes can enrich them (``build_training_set(duplicate_fraction=)``)."""
    wanted = has_twins if twins else has_shared_colour
    for _ in range(max_tries):
        scene = sample_clear_scene(rng, clearance)
        if wanted(scene):
            return scene
    raise RuntimeError(f"no scene with {'twins' if twins else 'a shared colour'} in {max_tries} draws")


def sample_clear_clip(rng: np.random.Generator, max_objects: int = 2, num_frames: int = VIDEO_FRAMES,
                      clearance: float = CLEARANCE, max_tries: int = 10000) -> VideoClip:
    """A ``sample_video`` clip of 1..``max_objects`` objects redrawn until :func:`clip_clearance` >=
    ``clearance`` (its narration is then robust to ``clearance`` errors in the first and last frames),
    with its objects in the first frame's reading order (:func:`clip_in_reading_order`): ``sample_video``
    lists them in a random order that no frame shows, and ``caption_video`` / ``narrate_video`` name them
    in list order, so without it the order of a caption's objects could not be read off the frames."""
    clearance = _check_clearance(clearance)
    num_objects = int(rng.integers(1, max_objects + 1))
    for _ in range(max_tries):
        clip = sample_video(rng, num_objects, num_frames)
        if clip_clearance(clip) >= clearance:
            return clip_in_reading_order(clip)
    raise RuntimeError(f"no clip of {num_objects} objects with clearance {clearance} in {max_tries} draws")


def image_example(split: str, seed: int, index: int, task: str, clearance: float = CLEARANCE,
                  difficulty: float = DIFFICULTY) -> dict:
    """Image example ``index`` of a split: a scene drawn by :func:`sample_clear_scene` from
    ``rng_for(split, seed, index)`` (``clearance=0``: any world scene), its 64x64 render (uint8
    ``[1, 64, 64, 3]``), the task's prompt and exact answer. Returns a dict with ``frames``, ``prompt``,
    ``answer``, ``task``, ``question`` and ``scene``."""
    if task in VIDEO_TASKS or task not in TASKS:
        raise ValueError(f"task must be an image task {[t for t in TASKS if t not in VIDEO_TASKS]}, got {task!r}")
    rng = rng_for(split, seed, index)
    scene = sample_clear_scene(rng, clearance)
    frames = render_scene(scene, IMAGE_SIZE, difficulty)[None]
    question = None
    if task == "describe":
        answer = describe_scene(scene)
    elif task == "caption":
        answer = caption_scene(scene)
    else:
        question, answer = sample_qa(scene, rng)
    return {"frames": frames, "prompt": task_prompt(task, question), "answer": answer, "task": task,
            "question": question, "scene": scene}


def _video_rng(split: str, seed: int, index: int) -> np.random.Generator:
    """The clip stream of a split: ``rng_for``'s seed sequence plus a salt, so clip ``i`` and scene ``i``
    of one split come from independent generators."""
    rng_for(split, seed, index)  # validates the arguments
    return np.random.default_rng([NAMESPACES[split], int(seed), int(index), VIDEO_SALT])


def video_example(split: str, seed: int, index: int, task: str, clearance: float = CLEARANCE,
                  num_frames: int = VIDEO_FRAMES, max_objects: int = 2, difficulty: float = DIFFICULTY) -> dict:
    """Video example ``index``: a clip of 1..``max_objects`` moving shapes (:func:`sample_clear_clip`),
    ``num_frames`` 64x64 frames (uint8 ``[T, 64, 64, 3]``), the task's prompt and exact answer (dict keys as
    :func:`image_example`, with ``clip`` instead of ``scene``)."""
    if task not in VIDEO_TASKS:
        raise ValueError(f"task must be a video task {list(VIDEO_TASKS)}, got {task!r}")
    clip = sample_clear_clip(_video_rng(split, seed, index), max_objects, num_frames, clearance)
    frames = render_video(clip, IMAGE_SIZE, difficulty)
    answer = narrate_video(clip) if task == "narrate" else caption_video(clip)
    return {"frames": frames, "prompt": task_prompt(task, None, num_frames), "answer": answer, "task": task,
            "question": None, "clip": clip}


PATCH_FIELDS: tuple[str, ...] = ("color", "shape", "size", "column", "row")  # class labels per patch, 0 = background


def patch_labels(scene: Scene) -> tuple[np.ndarray, np.ndarray]:
    """Per-patch ground truth of a scene for the recipe's auxiliary loss (not used by the model itself).

    Patch ``(r, c)`` of the 8x8 grid belongs to the object whose bounding box contains the patch centre
    (boxes never overlap). Returns ``classes`` int64 ``[64, 5]`` (``PATCH_FIELDS``: colour 1-9, shape
    1-4, size 1-3, region column 1-3 and row 1-3 of the object's centre; 0 on background) and ``offsets``
    float32 ``[64, 2]``: the object centre minus the patch centre, in patch units (0 on background).
    """
    centres = (np.arange(GRID) + 0.5) / GRID
    classes = np.zeros((GRID, GRID, len(PATCH_FIELDS)), np.int64)
    offsets = np.zeros((GRID, GRID, 2), np.float32)
    colors, shapes, sizes = list(COLORS), list(SHAPES), list(SIZES)
    for o in scene.objects:
        x0, y0, x1, y1 = o.bbox
        cols = np.flatnonzero((centres >= x0) & (centres <= x1))
        rows = np.flatnonzero((centres >= y0) & (centres <= y1))
        column, row = 1 + min(int(o.x * 3), 2), 1 + min(int(o.y * 3), 2)
        for r in rows:
            for c in cols:
                classes[r, c] = (1 + colors.index(o.color), 1 + shapes.index(o.shape), 1 + sizes.index(o.size),
                                 column, row)
                offsets[r, c] = ((o.x - centres[c]) * GRID, (o.y - centres[r]) * GRID)
    return classes.reshape(-1, len(PATCH_FIELDS)), offsets.reshape(-1, 2)


def encode_example(tokenizer, prompt: str, answer: str) -> tuple[list[int], int]:
    """Token ids of ``prompt`` (each ``<image>`` expanded to ``IMAGE_TOKENS`` placeholders, ``<s>`` first)
    followed by ``answer`` and ``</s>``, and the index where the answer starts (the loss covers
    ``ids[start:]``). Words outside the vocabulary raise ``ValueError``."""
    prompt_ids = tokenizer(prompt.replace(IMAGE, IMAGE * IMAGE_TOKENS))["input_ids"]
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    if tokenizer.unk_token_id in prompt_ids or tokenizer.unk_token_id in answer_ids:
        raise ValueError(f"words outside the shapes vocabulary in prompt {prompt!r} or answer {answer!r}")
    return prompt_ids + answer_ids + [tokenizer.eos_token_id], len(prompt_ids)


def build_training_set(num_images: int, num_videos: int, seed: int = 0, split: str = "train",
                       clearance: float = CLEARANCE, difficulty: float = DIFFICULTY, tokenizer=None,
                       duplicate_fraction: float = 0.0, workers: int = 1) -> dict:
    """Rendered frames and tokenized (prompt, answer) examples of every task, deterministic for the seed.

    Image scene ``i`` (``rng_for(split, seed, i)``, as :func:`image_example`) gives a "describe" example,
    plus a "caption" example when ``i % 5 == 0`` and a "qa" example when ``i % 5`` is 1 or 3. With
    ``duplicate_fraction`` f > 0, image scene ``i`` is replaced, with probability f, by a
    :func:`sample_duplicate_scene` from the same stream (twins for half of those): a mix enriched in the
    description's comparison sentences (f = 0 keeps the world's own distribution, bit for bit). Clip ``j``
    gives "narrate", plus "video_caption" when ``j % 3 == 0``. Returns ``images`` uint8 ``[S, 64, 64, 3]``,
    ``videos`` uint8 ``[V, T, 64, 64, 3]``, ``examples``: dicts with ``task``, ``video`` (bool), ``ref``
    (row of ``images`` or ``videos``), ``ids`` (list of token ids) and ``start`` (answer start), and the
    :func:`patch_labels` of every frame (images first, then the videos' frames in order):
    ``patch_classes`` uint8 ``[S + V * T, 64, 5]`` and ``patch_offsets`` float ``[S + V * T, 64, 2]``.
    ``workers`` > 1 builds slices of the scenes and clips in that many processes
    (:func:`~mmspec.world.parallel.build_in_parts`): the same set, sooner.
    """
    if not isinstance(num_images, int) or not isinstance(num_videos, int) or min(num_images, num_videos) < 0:
        raise ValueError(f"num_images and num_videos must be non-negative integers, got {num_images}, {num_videos}")
    if not isinstance(duplicate_fraction, (int, float)) or not 0 <= duplicate_fraction <= 1:
        raise ValueError(f"duplicate_fraction must be a number in [0, 1], got {duplicate_fraction!r}")
    check_positive_int(workers, "data workers")
    tokenizer = tokenizer or build_tokenizer()
    common = dict(seed=seed, split=split, clearance=clearance, difficulty=difficulty, tokenizer=tokenizer)
    scenes = build_in_parts(partial(_image_part, duplicate_fraction=duplicate_fraction, **common), num_images, workers)
    clips = build_in_parts(partial(_video_part, **common), num_videos, workers)
    images, videos = concat_parts(scenes), concat_parts(clips)
    return {"images": torch.from_numpy(images["frames"]), "videos": torch.from_numpy(videos["frames"]),
            "examples": images["examples"] + videos["examples"],
            "patch_classes": torch.from_numpy(np.concatenate([images["patches"], videos["patches"]])).to(torch.uint8),
            "patch_offsets": torch.from_numpy(np.concatenate([images["offsets"], videos["offsets"]]))}


def _example(tokenizer, task: str, video: bool, ref: int, prompt: str, answer: str) -> dict:
    ids, start = encode_example(tokenizer, prompt, answer)
    return {"task": task, "video": video, "ref": ref, "ids": ids, "start": start}


def _image_part(first: int, count: int, *, seed: int, split: str, clearance: float, difficulty: float, tokenizer,
                duplicate_fraction: float) -> dict:
    """Scenes ``first .. first + count - 1`` of :func:`build_training_set`: frames, patch labels, examples."""
    frames = np.zeros((count, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    patches = np.zeros((count, GRID * GRID, len(PATCH_FIELDS)), np.int64)
    offsets = np.zeros((count, GRID * GRID, 2), np.float32)
    examples = []
    for k, i in enumerate(range(first, first + count)):
        rng = rng_for(split, seed, i)
        scene = sample_clear_scene(rng, clearance)
        if duplicate_fraction and rng.random() < duplicate_fraction:
            scene = sample_duplicate_scene(rng, twins=bool(rng.random() < 0.5), clearance=clearance)
        frames[k] = render_scene(scene, IMAGE_SIZE, difficulty)
        patches[k], offsets[k] = patch_labels(scene)
        examples.append(_example(tokenizer, "describe", False, i, task_prompt("describe"), describe_scene(scene)))
        if i % 5 == 0:
            examples.append(_example(tokenizer, "caption", False, i, task_prompt("caption"), caption_scene(scene)))
        if i % 5 in (1, 3):
            question, answer = sample_qa(scene, rng)
            examples.append(_example(tokenizer, "qa", False, i, task_prompt("qa", question), answer))
    return {"frames": frames, "patches": patches, "offsets": offsets, "examples": examples}


def _video_part(first: int, count: int, *, seed: int, split: str, clearance: float, difficulty: float,
                tokenizer) -> dict:
    """Clips ``first .. first + count - 1`` of :func:`build_training_set`: frames, the patch labels of their
    frames in order (``[count * T, 64, ...]``), examples."""
    frames = np.zeros((count, VIDEO_FRAMES, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    patches = np.zeros((count * VIDEO_FRAMES, GRID * GRID, len(PATCH_FIELDS)), np.int64)
    offsets = np.zeros((count * VIDEO_FRAMES, GRID * GRID, 2), np.float32)
    examples = []
    for k, j in enumerate(range(first, first + count)):
        clip = sample_clear_clip(_video_rng(split, seed, j), 2, VIDEO_FRAMES, clearance)
        frames[k] = render_video(clip, IMAGE_SIZE, difficulty)
        for t in range(VIDEO_FRAMES):
            patches[k * VIDEO_FRAMES + t], offsets[k * VIDEO_FRAMES + t] = patch_labels(clip.scene_at(t))
        examples.append(_example(tokenizer, "narrate", True, j, task_prompt("narrate"), narrate_video(clip)))
        if j % 3 == 0:
            examples.append(_example(tokenizer, "video_caption", True, j, task_prompt("video_caption"),
                                     caption_video(clip)))
    return {"frames": frames, "patches": patches, "offsets": offsets, "examples": examples}
