"""The exact evaluator: parsing clean renders, GenEval-style scoring, robustness, video scores."""

import numpy as np
import pytest
import torch

from mmspec.world import (
    CATEGORIES,
    EvalPrompt,
    MotionSpec,
    ObjectSpec,
    VideoPrompt,
    clip_for_prompt,
    evaluate,
    evaluate_videos,
    make_prompt_set,
    make_video_prompt_set,
    parse_image,
    render_scene,
    render_video,
    rng_for,
    sample_scene,
    scene_for_prompt,
    scene_from_specs,
    scene_matches,
    score_image,
    score_video,
    to_tensor,
)
from mmspec.world.evaluator import label_components


def _parse_all(num, difficulty, image_size=32, seed=0):
    wrong = []
    for i in range(num):
        scene = sample_scene(rng_for("test", seed, i))
        if not scene_matches(parse_image(render_scene(scene, image_size, difficulty)), scene):
            wrong.append(i)
    return wrong


@pytest.mark.parametrize("difficulty", [1.0, 0.0])
def test_exact_on_1000_random_scenes(difficulty):
    assert _parse_all(1000, difficulty) == []


def test_exact_on_hard_scenes_and_other_sizes():
    assert _parse_all(300, 2.0, seed=1) == []
    assert _parse_all(60, 1.0, image_size=64, seed=2) == []
    assert _parse_all(30, 0.5, image_size=45, seed=3) == []
    assert _parse_all(5, 1.0, image_size=256, seed=4) == []


@pytest.mark.slow
def test_exact_on_many_scenes_all_difficulties():
    for d in (0.0, 0.5, 1.0, 1.5, 2.0):
        assert _parse_all(3000, d, seed=10) == [], d


def test_detection_fields():
    scene = scene_from_specs(np.random.default_rng(0), [("triangle", "orange", "large")])
    (det,) = parse_image(render_scene(scene))
    obj = scene.objects[0]
    assert (det.shape, det.color, det.size) == ("triangle", "orange", "large")
    assert abs(det.x - obj.x) < 1 / 32 and abs(det.y - obj.y) < 1 / 32
    assert all(abs(a - b) < 1 / 32 for a, b in zip(det.bbox, obj.bbox))
    assert det.match > 0.8
    assert 0.5 * 0.4**2 * 0.8 < det.area < 0.5 * 0.4**2 * 1.2  # a triangle covers half its box


def test_geneval_scores_perfect_on_prompt_scenes_and_mean_of_categories():
    prompts = make_prompt_set(50)
    images = [render_scene(scene_for_prompt(p, rng_for("test", 0, i))) for i, p in enumerate(prompts)]
    result = evaluate(images, prompts)
    assert result.overall == 1.0 and set(result.per_category) == set(CATEGORIES)
    # mismatched prompts: rotate images by one category block -> far from perfect
    rotated = images[50:] + images[:50]
    bad = evaluate(rotated, prompts)
    assert bad.overall < 0.7
    assert bad.overall == pytest.approx(np.mean(list(bad.per_category.values())))


def test_scoring_rules_negative_cases():
    rng = np.random.default_rng(1)
    two_circles = render_scene(scene_from_specs(rng, [("circle", "red", "small"), ("circle", "blue", "small")]))
    assert score_image(two_circles, EvalPrompt("two circles", "counting", (ObjectSpec("circle", None, 2),)))
    assert not score_image(two_circles, EvalPrompt("three circles", "counting", (ObjectSpec("circle", None, 3),)))
    assert score_image(two_circles, EvalPrompt("a circle", "single_object", (ObjectSpec("circle"),)))
    assert not score_image(two_circles, EvalPrompt("a square", "single_object", (ObjectSpec("square"),)))
    assert not score_image(two_circles, EvalPrompt("a green circle", "colors", (ObjectSpec("circle", "green"),)))
    attr = EvalPrompt("a red circle and a blue circle", "color_attr", (ObjectSpec("circle", "red"), ObjectSpec("circle", "blue")))
    assert score_image(two_circles, attr)
    swapped = EvalPrompt("a red square and a blue circle", "color_attr", (ObjectSpec("square", "red"), ObjectSpec("circle", "blue")))
    assert not score_image(two_circles, swapped)
    prompt = EvalPrompt("a circle to the left of a square", "position", (ObjectSpec("circle"), ObjectSpec("square")), "left of")
    scene = scene_for_prompt(prompt, 3)
    assert score_image(render_scene(scene), prompt)
    opposite = EvalPrompt("a circle to the right of a square", "position", (ObjectSpec("circle"), ObjectSpec("square")), "right of")
    assert not score_image(render_scene(scene), opposite)


def test_empty_noise_and_foreign_blobs():
    assert parse_image(np.zeros((32, 32, 3), np.uint8)) == []
    noise = np.random.default_rng(0).integers(0, 60, size=(32, 32, 3)).astype(np.uint8)
    assert parse_image(noise) == []
    blob = np.zeros((32, 32, 3), np.uint8)
    blob[14:17, 4:28] = (225, 30, 30)  # a thin bar: no shape of the world
    (det,) = parse_image(blob)
    assert det.shape == "unknown" and det.color == "red"
    grey = np.zeros((32, 32, 3), np.uint8)
    grey[8:20, 8:20] = (150, 150, 150)  # a square in a colour of no palette entry
    (det,) = parse_image(grey)
    assert det.color == "unknown"


def test_input_formats_and_errors():
    scene = sample_scene(3)
    img = render_scene(scene)
    expected = parse_image(img)
    assert parse_image(to_tensor(img)) == expected
    assert parse_image(img.astype(np.float32) / 255.0) == expected
    from PIL import Image

    assert parse_image(Image.fromarray(img)) == expected
    with pytest.raises(ValueError, match="square"):
        parse_image(np.zeros((32, 40, 3), np.uint8))
    with pytest.raises(ValueError, match="size"):
        parse_image(np.zeros((16, 16, 3), np.uint8))
    with pytest.raises(ValueError, match="shape"):
        parse_image(np.zeros((32, 32), np.uint8))
    with pytest.raises(ValueError, match="same length"):
        evaluate([img], [])
    with pytest.raises(ValueError, match="EvalPrompt"):
        score_image(img, "a circle")


def test_label_components_joins_diagonals_and_numbers_in_raster_order():
    mask = np.array([[0, 0, 0, 1, 0, 0],
                     [1, 0, 0, 0, 1, 0],   # (1, 4) touches (0, 3) diagonally: one component
                     [0, 1, 0, 0, 0, 0],   # (2, 1) touches (1, 0) diagonally
                     [0, 0, 0, 1, 1, 0],
                     [1, 0, 0, 0, 0, 0]], dtype=bool)
    labels, count = label_components(mask)
    assert count == 4 and labels.dtype == np.int32
    expected = np.array([[0, 0, 0, 1, 0, 0],
                         [2, 0, 0, 0, 1, 0],
                         [0, 2, 0, 0, 0, 0],
                         [0, 0, 0, 3, 3, 0],
                         [4, 0, 0, 0, 0, 0]])
    assert np.array_equal(labels, expected)
    assert label_components(np.zeros((4, 4), bool))[1] == 0


def test_video_scoring():
    prompts = make_video_prompt_set(16)
    clips = [clip_for_prompt(p, rng_for("test", 0, i), num_frames=8) for i, p in enumerate(prompts)]
    for d in (0.0, 1.0):
        result = evaluate_videos([render_video(c, 32, d) for c in clips], prompts)
        assert result.accuracy == 1.0 and result.frame_score == 1.0
    clip, prompt = clips[0], prompts[0]
    frames = render_video(clip)
    assert score_video(torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255, prompt).correct
    reversed_score = score_video(frames[::-1].copy(), prompt)
    assert reversed_score.identity and not reversed_score.motion and not reversed_score.correct
    shuffled = frames[[0, 5, 2, 7, 1, 6, 3, 4]]
    assert not score_video(shuffled, prompt).motion
    blanked = frames.copy()
    blanked[3] = 0
    s = score_video(blanked, prompt)
    assert not s.identity and s.frame_scores[3] == 0.0 and s.frame_scores[0] == 1.0
    wrong = VideoPrompt("x", (MotionSpec(prompt.objects[0].shape, prompt.objects[0].color, "left" if prompt.objects[0].direction != "left" else "right"),))
    assert not score_video(frames, wrong).correct
    with pytest.raises(ValueError, match="VideoPrompt"):
        score_video(frames, "a red circle moving right")
    with pytest.raises(ValueError, match="frames"):
        score_video(frames[0], prompt)


def test_noise_and_fragment_images_satisfy_no_prompt():
    """The parser reads every blob; an image that is not a valid scene must fail even 'a circle'."""
    import numpy as np

    from mmspec.world import is_valid_scene, make_prompt_set, parse_image, score_image

    rng = np.random.default_rng(0)
    prompts = make_prompt_set()[:50]
    for _trial in range(20):
        # random tokens-like mosaic of 4x4 coloured patches
        patches = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
        image = np.kron(patches, np.ones((4, 4, 1), dtype=np.uint8))
        if not is_valid_scene(parse_image(image)):
            assert not any(score_image(image, p) for p in prompts)
    noise = rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
    assert not any(score_image(noise, p) for p in prompts)


def test_stacked_template_errors_equal_one_template_at_a_time():
    """``_template_errors`` scores all placements in one array operation; each error must equal, bit for bit,
    the same template placed and compared alone (the parser's decisions depend on exact ties)."""
    from mmspec.world.evaluator import SUPERSAMPLE, _soft, _template_errors
    from mmspec.world.render import coverage_patch

    def alone(alpha, mass, shape, side_hi, left, top, wx0, wy0):
        patch = coverage_patch(shape, side_hi, left % SUPERSAMPLE, top % SUPERSAMPLE, SUPERSAMPLE)
        px, py = left // SUPERSAMPLE - wx0, top // SUPERSAMPLE - wy0
        tmpl = np.zeros(alpha.shape, dtype=np.float32)
        for y in range(patch.shape[0]):
            for x in range(patch.shape[1]):
                if 0 <= py + y < alpha.shape[0] and 0 <= px + x < alpha.shape[1]:
                    tmpl[py + y, px + x] = patch[y, x]
        tmpl = _soft(tmpl)
        return float(np.abs(tmpl - alpha).sum()) / max(mass + float(tmpl.sum()), 1e-6)

    rng = np.random.default_rng(0)
    for wh, ww in ((9, 11), (14, 14), (6, 20)):
        alpha = _soft(rng.random((wh, ww), dtype=np.float32)).astype(np.float32)
        mass = float(alpha.sum())
        placements = [(shape, int(side), int(rng.integers(-8, 4 * ww)), int(rng.integers(-8, 4 * wh)))
                      for shape in ("circle", "square", "triangle", "diamond") for side in rng.integers(6, 40, 6)]
        errors = _template_errors(alpha, mass, placements, 3, 5)
        assert errors == [alone(alpha, mass, *p, 3, 5) for p in placements]
        assert len(set(errors)) > 1
