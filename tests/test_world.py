"""Shapes world: scenes, rendering and the difficulty knob, texts, prompts, videos, datasets."""

import itertools
import time

import numpy as np
import pytest
import torch
from PIL import Image

from mmspec.world import (
    CATEGORIES,
    COLORS,
    MIN_GAP,
    RELATIONS,
    SHAPES,
    SIZES,
    EvalPrompt,
    ObjectSpec,
    Scene,
    ShapesImageDataset,
    ShapesImageStream,
    ShapesVideoDataset,
    ShapesVideoStream,
    VideoClip,
    WorldObject,
    caption_scene,
    caption_video,
    clip_for_prompt,
    describe_scene,
    enumerate_prompts,
    make_prompt_set,
    make_video_prompt_set,
    narrate_video,
    qa_pairs,
    relations_between,
    render_scene,
    render_video,
    rng_for,
    sample_prompt,
    sample_qa,
    sample_scene,
    sample_video,
    scene_for_prompt,
    scene_from_specs,
    split_words,
    to_pil,
    to_tensor,
    to_uint8,
    vocabulary,
)
from mmspec.world.prompts import NUMBER_WORDS
from mmspec.world.render import BACKGROUND_TINT, object_color
from mmspec.world.scene import dominant_relation, region_name, sample_related_pair, separated

# ----------------------------------------------------------------------------------------------------
# constants and scene constraints
# ----------------------------------------------------------------------------------------------------


def test_palette_is_far_apart_and_bright():
    assert len(COLORS) >= 6 and len(SHAPES) >= 3
    for a, b in itertools.combinations(COLORS, 2):
        assert np.linalg.norm(np.subtract(COLORS[a], COLORS[b])) >= 100, (a, b)
    assert all(max(rgb) >= 195 for rgb in COLORS.values())
    sides = sorted(SIZES.values())
    assert all(b / a > 1.3 for a, b in zip(sides, sides[1:]))


def test_sample_scene_is_deterministic_and_valid():
    scenes = [sample_scene(rng_for("train", 0, i)) for i in range(400)]
    again = [sample_scene(rng_for("train", 0, i)) for i in range(400)]
    assert scenes == again
    assert all(s.is_valid() for s in scenes)
    assert {len(s) for s in scenes} == {1, 2, 3, 4}
    other = [sample_scene(rng_for("val", 0, i)) for i in range(20)]
    assert other != scenes[:20]
    assert {o.shape for s in scenes for o in s.objects} == set(SHAPES)
    assert {o.color for s in scenes for o in s.objects} == set(COLORS)


def test_scene_roundtrip_and_count():
    scene = sample_scene(5, num_objects=4)
    back = Scene.from_dict(scene.to_dict())
    assert back == scene
    assert scene.count() == 4
    assert sum(scene.count(shape=s) for s in SHAPES) == 4


def test_scene_bad_names_raise_clear_errors():
    with pytest.raises(ValueError, match="shape"):
        WorldObject("hexagon", "red", "small", 0.5, 0.5)
    with pytest.raises(ValueError, match="color"):
        WorldObject("circle", "mauve", "small", 0.5, 0.5)
    with pytest.raises(ValueError, match="size"):
        WorldObject("circle", "red", "huge", 0.5, 0.5)
    with pytest.raises(ValueError, match="shade"):
        WorldObject("circle", "red", "small", 0.5, 0.5, (2.0, 0, 0))
    with pytest.raises(ValueError, match="num_objects"):
        sample_scene(0, num_objects=5)
    with pytest.raises(ValueError, match="relation"):
        sample_related_pair(np.random.default_rng(0), ("circle", None), ("square", None), "behind")
    with pytest.raises(ValueError, match="namespace"):
        rng_for("nope", 0, 0)
    with pytest.raises(ValueError, match="1 to 4"):
        scene_from_specs(np.random.default_rng(0), [("circle", None, None)] * 5)
    with pytest.raises(ValueError, match="rng"):
        sample_scene("seed")


def test_relations_geneval_rule():
    left = (0.1, 0.4, 0.3, 0.6)
    right = (0.7, 0.4, 0.9, 0.6)
    assert relations_between(left, right) == {"left of"}
    assert relations_between(right, left) == {"right of"}
    top = (0.4, 0.05, 0.6, 0.25)
    assert relations_between(top, right) == {"left of", "above"}  # diagonal: both
    assert relations_between(left, left) == set()


def test_dominant_relation_always_scores_true():
    for i in range(500):
        scene = sample_scene(i, num_objects=2)
        a, b = scene.objects
        assert dominant_relation(a, b) in relations_between(a.bbox, b.bbox)
        assert separated(a, b, MIN_GAP)


def test_related_pairs_hold_clearly():
    rng = np.random.default_rng(0)
    for relation in RELATIONS:
        for _ in range(50):
            scene = sample_related_pair(rng, ("circle", None), ("triangle", "red"), relation)
            a, b = scene.objects
            rels = relations_between(a.bbox, b.bbox)
            assert relation in rels and scene.is_valid() and b.color == "red"
            opposite = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}[relation]
            assert opposite not in rels


# ----------------------------------------------------------------------------------------------------
# rendering and the difficulty knob
# ----------------------------------------------------------------------------------------------------


def test_render_is_deterministic_and_shaped():
    scene = sample_scene(1)
    img = render_scene(scene)
    assert img.shape == (32, 32, 3) and img.dtype == np.uint8
    assert np.array_equal(img, render_scene(scene))
    assert render_scene(scene, image_size=64).shape == (64, 64, 3)
    assert render_scene(scene, image_size=256, difficulty=2).shape == (256, 256, 3)


def test_difficulty_zero_is_flat():
    scene = scene_from_specs(np.random.default_rng(3), [("square", "red", "large"), ("circle", "blue", "small")])
    img = render_scene(scene, difficulty=0)
    colors = {tuple(int(v) for v in px) for px in img.reshape(-1, 3)}
    assert colors == {(0, 0, 0), COLORS["red"], COLORS["blue"]}


def test_difficulty_adds_jitter_antialiasing_noise_and_texture():
    scene = scene_from_specs(np.random.default_rng(4), [("circle", "green", "large")])
    obj = scene.objects[0]
    assert not np.allclose(object_color(obj, 1.0), COLORS["green"])  # shade jitter
    assert np.abs(object_color(obj, 1.0) - COLORS["green"]).max() <= 10 + 1e-6
    flat, default, hard = (render_scene(scene, difficulty=d).astype(float) for d in (0, 1, 2))
    # anti-aliasing: at difficulty 0 every pixel is either background or object; at 1 some are mixed
    bright0 = flat.max(axis=2)
    assert set(np.unique(bright0)) <= {0.0, float(max(COLORS["green"]))}
    corner = (slice(0, 4), slice(0, 4))
    mask = np.ones((32, 32), bool)
    x0, y0, x1, y1 = (int(v * 32) for v in obj.bbox)
    mask[max(y0 - 2, 0) : y1 + 3, max(x0 - 2, 0) : x1 + 3] = False  # far from the object
    bg1, bg2 = default[mask], hard[mask]
    assert bg1.std() > 1.0  # pixel noise
    assert bg1.max() < 70 and bg2.max() < 110  # backgrounds stay dark
    assert bg2.std() > bg1.std()  # texture + stronger noise
    assert flat[corner].max() == 0
    mixed = ((default.max(axis=2) > 60) & (default.max(axis=2) < 150)).sum()
    assert mixed >= 4  # anti-aliased edge pixels
    assert default[mask].mean() <= BACKGROUND_TINT * 1 + 5


def test_render_bad_inputs():
    scene = sample_scene(0)
    for size in (31, 257, 32.0, True):
        with pytest.raises(ValueError, match="image_size"):
            render_scene(scene, image_size=size)
    for d in (-0.1, 2.5, "1"):
        with pytest.raises(ValueError, match="difficulty"):
            render_scene(scene, difficulty=d)
    with pytest.raises(ValueError, match="Scene"):
        render_scene({"objects": []})


def test_render_speed():
    scenes = [sample_scene(i) for i in range(300)]
    start = time.perf_counter()
    for s in scenes:
        render_scene(s)
    rate = len(scenes) / (time.perf_counter() - start)
    assert rate > 500, f"only {rate:.0f} images/s"  # measured ~10k/s on one core


def test_image_conversions():
    img = render_scene(sample_scene(2))
    t = to_tensor(img)
    assert t.shape == (3, 32, 32) and t.dtype == torch.float32 and 0 <= t.min() and t.max() <= 1
    assert np.array_equal(to_uint8(t), img)
    assert np.array_equal(to_uint8(to_pil(img)), img)
    assert to_tensor(np.stack([img, img])).shape == (2, 3, 32, 32)
    with pytest.raises(ValueError, match="uint8"):
        to_tensor(img.astype(np.float32))
    with pytest.raises(ValueError, match="shape"):
        to_uint8(torch.zeros(4, 32, 32))


# ----------------------------------------------------------------------------------------------------
# texts
# ----------------------------------------------------------------------------------------------------


def test_caption_names_every_object():
    for i in range(200):
        scene = sample_scene(i)
        words = caption_scene(scene).split()
        for o in scene.objects:
            assert o.color in words and o.shape in words and o.size in words
        assert caption_scene(scene) == caption_scene(scene)


def test_description_is_long_and_complete():
    lengths = []
    for i in range(100):
        scene = sample_scene(i, num_objects=4)
        text = describe_scene(scene)
        lengths.append(len(split_words(text)))
        for o in scene.objects:
            assert f"{o.size} {o.color} {o.shape}" in text
        assert "in total there" in text
    assert min(lengths) >= 60


def test_qa_answers_are_right():
    for i in range(100):
        scene = sample_scene(i)
        pairs = dict(qa_pairs(scene))
        assert pairs["how many shapes are there?"] == NUMBER_WORDS[len(scene)]
        for c in COLORS:
            assert pairs[f"how many {c} shapes are there?"] == NUMBER_WORDS[scene.count(color=c)]
        for s in SHAPES:
            assert pairs[f"how many {s}s are there?"] == NUMBER_WORDS[scene.count(shape=s)]
            if scene.count(shape=s) == 1:
                assert pairs[f"what color is the {s}?"] == next(o.color for o in scene.objects if o.shape == s)
        for o in scene.objects:
            assert pairs[f"is there {'an' if o.color[0] in 'aeiou' else 'a'} {o.color} {o.shape}?"] == "yes"
            if scene.count(shape=o.shape, color=o.color) == 1:
                assert pairs[f"where is the {o.color} {o.shape}?"] == region_name(o.x, o.y)
        q, a = sample_qa(scene, i)
        assert pairs[q] == a


def test_qa_kind_names_the_template_of_every_question():
    from mmspec.world import qa_kind
    from mmspec.world.captions import QA_KINDS

    seen = set()
    for i in range(60):
        scene = sample_scene(i)
        for kind, make in QA_KINDS.items():
            for question, _ in make(scene):
                found = qa_kind(question)
                assert found.split(" ")[0] == kind, (question, found)
                seen.add(found)
    assert {"count (all)", "count (color)", "count (shape)"} <= seen and len(seen) == len(QA_KINDS) + 2
    assert qa_kind("how many red shapes are there?") == "count (color)"
    assert qa_kind("how many circles are there?") == "count (shape)"
    with pytest.raises(ValueError, match="not a question of the world's templates"):
        qa_kind("why is the sky blue")


def test_all_texts_use_the_vocabulary():
    vocab = set(vocabulary())
    texts = []
    for i in range(150):
        scene = sample_scene(i)
        texts += [caption_scene(scene), describe_scene(scene)]
        texts += [w for pair in qa_pairs(scene) for w in pair]
        clip = sample_video(i)
        texts += [caption_video(clip), narrate_video(clip)]
    texts += [p.text for c in CATEGORIES for p in enumerate_prompts(c)]
    texts += [p.text for p in make_video_prompt_set(50)]
    used = {w for t in texts for w in split_words(t)}
    assert used <= vocab, used - vocab
    assert len(vocab) < 200


# ----------------------------------------------------------------------------------------------------
# prompts
# ----------------------------------------------------------------------------------------------------


def test_prompt_set_is_fixed_balanced_and_scorable():
    prompts = make_prompt_set()
    assert len(prompts) == 600
    assert [p.to_dict() for p in prompts] == [p.to_dict() for p in make_prompt_set()]
    assert [p.text for p in make_prompt_set(seed=1)] != [p.text for p in prompts]
    for c in CATEGORIES:
        assert sum(p.category == c for p in prompts) == 100
    # distinct prompts where the category has enough of them
    assert len({p.text for p in prompts if p.category == "color_attr"}) == 100
    assert len({p.text for p in prompts if p.category == "single_object"}) == len(SHAPES)
    for p in prompts:
        assert EvalPrompt.from_dict(p.to_dict()) == p


def test_scene_for_prompt_satisfies_it_and_nothing_contradicting():
    prompts = make_prompt_set(40)
    for i, p in enumerate(prompts):
        scene = scene_for_prompt(p, i)
        assert scene.is_valid()
        assert p.is_satisfied_by(scene.objects), (p.text, scene)
        assert scene.meta["caption"] == p.text
    # counting: exactly the number, so one more or one fewer fails
    p = EvalPrompt("three circles", "counting", (ObjectSpec("circle", None, 3),))
    scene = scene_for_prompt(p, 0)
    assert p.is_satisfied_by(scene.objects)
    assert not p.is_satisfied_by(scene.objects[:2])


def test_prompt_texts_and_validation():
    assert sample_prompt("counting", 0).text.split()[0] in ("two", "three", "four")
    assert {len(enumerate_prompts(c)) for c in CATEGORIES} == {4, 12, 36, 48, 864}
    with pytest.raises(ValueError, match="category"):
        sample_prompt("size", 0)
    with pytest.raises(ValueError, match="relation"):
        EvalPrompt("a circle", "position", (ObjectSpec("circle"), ObjectSpec("square")))
    with pytest.raises(ValueError, match="object spec"):
        EvalPrompt("a circle", "two_object", (ObjectSpec("circle"),))
    with pytest.raises(ValueError, match="count"):
        ObjectSpec("circle", None, 7)
    with pytest.raises(ValueError, match="color"):
        ObjectSpec("circle", "beige")
    with pytest.raises(ValueError, match="n_per_category"):
        make_prompt_set(0)


# ----------------------------------------------------------------------------------------------------
# videos
# ----------------------------------------------------------------------------------------------------


def test_video_clips_move_with_constant_velocity_inside_the_canvas():
    for i in range(60):
        clip = sample_video(i, num_frames=12)
        scenes = clip.scenes()
        assert len(scenes) == 12 and all(s.is_valid() for s in scenes)
        assert len({(o.shape, o.color) for o in clip.objects}) == len(clip.objects)
        for k in range(len(clip.objects)):
            xs = np.array([s.objects[k].x for s in scenes])
            ys = np.array([s.objects[k].y for s in scenes])
            assert np.allclose(np.diff(xs), np.diff(xs)[0]) and np.allclose(np.diff(ys), np.diff(ys)[0])
            assert np.hypot(xs[-1] - xs[0], ys[-1] - ys[0]) >= 0.15 - 1e-9
        assert VideoClip.from_dict(clip.to_dict()) == clip


def test_video_render_caption_and_narration():
    clip = sample_video(3, num_objects=2, num_frames=8)
    frames = render_video(clip, image_size=32, difficulty=1)
    assert frames.shape == (8, 32, 32, 3) and frames.dtype == np.uint8
    assert not np.array_equal(frames[0], frames[-1])
    caption = caption_video(clip)
    assert caption.count("moving") == 2
    for o in clip.objects:
        assert f"{o.color} {o.shape} moving" in caption
    assert len(split_words(narrate_video(clip))) >= 60
    with pytest.raises(ValueError, match="num_frames"):
        sample_video(0, num_frames=64)
    with pytest.raises(ValueError, match="num_objects"):
        sample_video(0, num_objects=4)


def test_video_prompts():
    prompts = make_video_prompt_set(20)
    assert [p.text for p in prompts] == [p.text for p in make_video_prompt_set(20)]
    for i, p in enumerate(prompts):
        clip = clip_for_prompt(p, i, num_frames=8)
        assert caption_video(clip) == p.text
        assert [o.direction for o in p.objects] == list(clip.directions)


# ----------------------------------------------------------------------------------------------------
# datasets
# ----------------------------------------------------------------------------------------------------


def test_image_dataset_is_deterministic_and_collates():
    ds = ShapesImageDataset(50, seed=3)
    a, b = ds[7], ShapesImageDataset(50, seed=3)[7]
    assert torch.equal(a["image"], b["image"]) and a["caption"] == b["caption"]
    assert a["image"].shape == (3, 32, 32)
    assert ds[-1]["index"] == 49
    assert set(a) == {"image", "caption", "category", "index", "description", "question", "answer"}
    assert ShapesImageDataset(50, seed=4)[7]["caption"] != a["caption"] or not torch.equal(
        ShapesImageDataset(50, seed=4)[7]["image"], a["image"]
    )
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert batch["image"].shape == (4, 3, 32, 32) and len(batch["caption"]) == 4
    # the caption is true of the sample's scene
    for i in range(50):
        s = ds.sample(i)
        if s.category == "scene":
            assert s.caption == caption_scene(s.scene)
        else:
            assert s.scene.meta["caption"] == s.caption
    with pytest.raises(IndexError):
        ds[50]
    with pytest.raises(ValueError, match="split"):
        ShapesImageDataset(5, split="dev")
    with pytest.raises(ValueError, match="categories"):
        ShapesImageDataset(5, categories={"size": 1.0})
    with pytest.raises(ValueError, match="num_samples"):
        ShapesImageDataset(0)


def test_category_weights_and_texts_flag():
    ds = ShapesImageDataset(40, categories={"counting": 1.0}, texts=False, image_size=48, difficulty=0)
    item = ds[0]
    assert set(item) == {"image", "caption", "category", "index"} and item["image"].shape == (3, 48, 48)
    assert all(ds.sample(i).category == "counting" for i in range(40))


def test_streams_match_datasets_and_shard_workers():
    ds = ShapesImageDataset(6, seed=1, texts=False)
    stream = iter(ShapesImageStream(seed=1, texts=False))
    for i in range(6):
        item = next(stream)
        assert item["index"] == i and torch.equal(item["image"], ds[i]["image"])
    loader = torch.utils.data.DataLoader(ShapesImageStream(seed=1, texts=False), batch_size=2, num_workers=2)
    seen = []
    for k, batch in enumerate(loader):
        seen += batch["index"].tolist()
        if k == 3:
            break
    assert sorted(seen) == list(range(8))  # workers take disjoint indices


def test_video_datasets():
    ds = ShapesVideoDataset(4, num_frames=6, max_objects=3)
    item = ds[2]
    assert item["frames"].shape == (6, 3, 32, 32) and "moving" in item["caption"]
    assert torch.equal(item["frames"], ShapesVideoDataset(4, num_frames=6, max_objects=3)[2]["frames"])
    first = next(iter(ShapesVideoStream(num_frames=6, max_objects=3)))
    assert torch.equal(first["frames"], ds[0]["frames"])
    with pytest.raises(ValueError, match="max_objects"):
        ShapesVideoDataset(4, max_objects=5)


def test_pil_input_roundtrip():
    img = render_scene(sample_scene(0))
    pil = to_pil(img)
    assert isinstance(pil, Image.Image) and pil.size == (32, 32)
