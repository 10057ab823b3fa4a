"""GenEval protocol: the rebuilt COCO prompt file, metadata validation, the scoring rules on hand-made
detections, the shapes world scored on ground truth (1.0) and on deliberately wrong images, detectors,
generation sharding, the summary and the command line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmspec.evaluation import distributed
from mmspec.evaluation import geneval as gv
from mmspec.evaluation.geneval import (
    CATEGORIES,
    Detections,
    GenEvalOptions,
    NearestColorClassifier,
    evaluate_detections,
    evaluate_folder,
    generate_coco_metadata,
    generate_images,
    generate_shapes_metadata,
    load_metadata,
    shapes_ground_truth_generator,
    summarize,
    validate_metadata,
)

# --------------------------------------------------------------------------------------------
# The COCO prompt file
# --------------------------------------------------------------------------------------------

# Rows of GenEval's published evaluation_metadata.jsonl, as quoted in public code that uses the file
# (index in the file -> row); the rebuilt file must reproduce them at the same positions.
OFFICIAL_ROWS = {
    0: {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"},
    1: {"tag": "single_object", "include": [{"class": "cow", "count": 1}], "prompt": "a photo of a cow"},
    2: {"tag": "single_object", "include": [{"class": "bicycle", "count": 1}], "prompt": "a photo of a bicycle"},
    457: {"tag": "color_attr", "include": [{"class": "oven", "count": 1, "color": "pink"},
                                           {"class": "motorcycle", "count": 1, "color": "green"}],
          "prompt": "a photo of a pink oven and a green motorcycle"},
    503: {"tag": "color_attr", "include": [{"class": "cow", "count": 1, "color": "blue"},
                                           {"class": "computer keyboard", "count": 1, "color": "black"}],
          "prompt": "a photo of a blue cow and a black computer keyboard"},
    530: {"tag": "color_attr", "include": [{"class": "suitcase", "count": 1, "color": "purple"},
                                           {"class": "pizza", "count": 1, "color": "orange"}],
          "prompt": "a photo of a purple suitcase and an orange pizza"},
}
OFFICIAL_EXAMPLES = [  # rows quoted without their index
    {"tag": "counting", "include": [{"class": "clock", "count": 2}], "exclude": [{"class": "clock", "count": 3}],
     "prompt": "a photo of two clocks"},
    {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "pink"}], "prompt": "a photo of a pink car"},
    {"tag": "position", "include": [{"class": "teddy bear", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}],
     "prompt": "a photo of a dog right of a teddy bear"},
    {"tag": "color_attr", "include": [{"class": "wine glass", "count": 1, "color": "purple"}, {"class": "apple", "count": 1, "color": "black"}],
     "prompt": "a photo of a purple wine glass and a black apple"},
    {"tag": "color_attr", "include": [{"class": "giraffe", "count": 1, "color": "brown"}, {"class": "stop sign", "count": 1, "color": "white"}],
     "prompt": "a photo of a brown giraffe and a white stop sign"},
]


def test_coco_metadata_reproduces_geneval_prompt_file():
    rows = generate_coco_metadata()
    assert len(rows) == 553
    counts = {t: sum(r["tag"] == t for r in rows) for t in CATEGORIES}
    assert counts == {"single_object": 80, "two_object": 99, "counting": 80, "colors": 94, "position": 100, "color_attr": 100}
    for index, row in OFFICIAL_ROWS.items():
        assert rows[index] == row
    lines = [json.dumps(r) for r in rows]
    for row in OFFICIAL_EXAMPLES:
        assert json.dumps(row) in lines  # same key order and JSON formatting as the official file
    assert {r["include"][0]["class"] for r in rows if r["tag"] == "single_object"} == set(gv.COCO_CLASSES)
    assert not any(c.get("color") and c["class"] == "person" for r in rows for c in r["include"])
    assert generate_coco_metadata() == rows  # deterministic
    assert generate_coco_metadata(seed=44) != rows


def test_metadata_files_roundtrip_and_validation(tmp_path):
    rows = generate_coco_metadata()
    path = gv.write_metadata(tmp_path / "evaluation_metadata.jsonl", rows)
    assert load_metadata(path) == rows  # an official-format file is accepted by path
    bad_rows = [
        ({"tag": "counting_objects", "include": [{"class": "dog", "count": 1}], "prompt": "x"}, "unknown category"),
        ({"tag": "colors", "include": [], "prompt": "x"}, "non-empty 'include'"),
        ({"tag": "colors", "include": [{"class": "dog", "color": "teal"}], "prompt": "x"}, "unknown colour"),
        ({"tag": "position", "include": [{"class": "dog", "position": ["left of", 0]}], "prompt": "x"}, "bad position"),
        ({"tag": "counting", "include": [{"class": "dog", "count": 0}], "prompt": "x"}, "bad count"),
        ({"tag": "colors", "include": [{"class": "dog"}]}, "no prompt"),
        ({"tag": "colors", "include": [{"class": "hexagon"}], "prompt": "x", "world": "shapes"}, "unknown class"),
    ]
    for row, message in bad_rows:
        with pytest.raises(ValueError, match=message):
            validate_metadata([rows[0], row], source="prompts.jsonl")
    (tmp_path / "broken.jsonl").write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        load_metadata(tmp_path / "broken.jsonl")
    with pytest.raises(FileNotFoundError):
        load_metadata(tmp_path / "missing.jsonl")


# --------------------------------------------------------------------------------------------
# The GenEval rules on hand-made detections
# --------------------------------------------------------------------------------------------


def _det(objs):
    return Detections(np.array([o[1] for o in objs], dtype=float).reshape(-1, 4), [o[0] for o in objs], [o[2] for o in objs])


def test_counting_uses_include_exclude_and_the_counting_threshold():
    meta = {"tag": "counting", "include": [{"class": "clock", "count": 2}], "exclude": [{"class": "clock", "count": 3}], "prompt": "x"}
    img = Image.new("RGB", (100, 100))
    two = [("clock", (0, 0, 10, 10), 0.95), ("clock", (50, 50, 60, 60), 0.92)]
    assert evaluate_detections(img, _det(two), meta)[0]
    ok, reason = evaluate_detections(img, _det(two + [("clock", (80, 0, 90, 10), 0.99)]), meta)
    assert not ok and "clock<3" in reason
    low = [("clock", (0, 0, 10, 10), 0.95), ("clock", (50, 50, 60, 60), 0.5)]  # below the 0.9 counting threshold
    assert not evaluate_detections(img, _det(low), meta)[0]
    # With a lower counting threshold both clocks count (and still fewer than three).
    assert evaluate_detections(img, _det(low), meta, options=GenEvalOptions(counting_threshold=0.4))[0]


def test_two_objects_positions_and_thresholds():
    img = Image.new("RGB", (200, 100))
    position = {"tag": "position", "include": [{"class": "teddy bear", "count": 1},
                                               {"class": "dog", "count": 1, "position": ["right of", 0]}], "prompt": "x"}
    right = [("teddy bear", (10, 40, 50, 80), 0.8), ("dog", (120, 40, 160, 80), 0.7)]
    left = [("teddy bear", (120, 40, 160, 80), 0.8), ("dog", (10, 40, 50, 80), 0.7)]
    assert evaluate_detections(img, _det(right), position)[0]
    ok, reason = evaluate_detections(img, _det(left), position)
    assert not ok and "left of" in reason
    overlapping = [("teddy bear", (50, 40, 100, 80), 0.8), ("dog", (55, 40, 105, 80), 0.7)]  # 5 px apart: no relation
    assert not evaluate_detections(img, _det(overlapping), position)[0]
    two = {"tag": "two_object", "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1}], "prompt": "x"}
    assert evaluate_detections(img, _det([("dog", (0, 0, 9, 9), 0.4), ("cat", (20, 0, 29, 9), 0.5)]), two)[0]
    assert not evaluate_detections(img, _det([("dog", (0, 0, 9, 9), 0.2), ("cat", (20, 0, 29, 9), 0.5)]), two)[0]
    # Class-wise NMS (off by default) merges duplicate boxes.
    dup = [("dog", (0, 0, 10, 10), 0.95), ("dog", (1, 0, 11, 10), 0.94)]
    count2 = {"tag": "counting", "include": [{"class": "dog", "count": 2}], "exclude": [{"class": "dog", "count": 3}], "prompt": "x"}
    assert evaluate_detections(img, _det(dup), count2)[0]
    assert not evaluate_detections(img, _det(dup), count2, options=GenEvalOptions(nms_threshold=0.5))[0]


def test_colours_via_a_colour_classifier_on_boxes_and_masks():
    img = Image.new("RGB", (100, 50), (0, 0, 0))
    img.paste((220, 30, 30), (5, 5, 45, 45))  # a red object on the left
    img.paste((40, 80, 240), (55, 5, 95, 45))  # a blue one on the right
    det = _det([("car", (5, 5, 45, 45), 0.9), ("bus", (55, 5, 95, 45), 0.9)])
    red_car = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "x"}
    blue_car = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "blue"}], "prompt": "x"}
    attr = {"tag": "color_attr", "include": [{"class": "car", "count": 1, "color": "red"},
                                             {"class": "bus", "count": 1, "color": "blue"}], "prompt": "x"}
    swapped = {"tag": "color_attr", "include": [{"class": "car", "count": 1, "color": "blue"},
                                                {"class": "bus", "count": 1, "color": "red"}], "prompt": "x"}
    clf = NearestColorClassifier()
    assert evaluate_detections(img, det, red_car, clf)[0]
    assert not evaluate_detections(img, det, blue_car, clf)[0]
    assert evaluate_detections(img, det, attr, clf)[0]
    assert not evaluate_detections(img, det, swapped, clf)[0]
    with pytest.raises(ValueError, match="colour classifier"):
        evaluate_detections(img, det, red_car, None)
    # A mask restricts the crop to the object: a box covering both objects, the mask only the blue one.
    mask = np.zeros((50, 100), bool)
    mask[5:45, 55:95] = True
    masked = Detections(np.array([[0, 0, 100, 50]]), ["car"], [0.9], masks=[mask])
    assert evaluate_detections(img, masked, blue_car, clf)[0]
    # Detections that carry colours (the shapes parser) skip the classifier.
    colored = Detections(np.array([[5, 5, 45, 45]]), ["car"], [0.9], colors=["blue"])
    assert evaluate_detections(img, colored, blue_car, None)[0]
    with pytest.raises(ValueError, match="3 boxes, 2 labels"):
        Detections(np.zeros((3, 4)), ["a", "b"], [1, 1])


# --------------------------------------------------------------------------------------------
# The shapes world: ground truth scores 1.0, wrong images lose exactly where they should
# --------------------------------------------------------------------------------------------


def _wrong_generator(kind: str):
    """Render a scene for the prompt, then break it: 'recolor' every object, or 'drop' all but one."""
    from mmspec.world.prompts import _cached_prompts, scene_for_prompt
    from mmspec.world.render import render_scene
    from mmspec.world.scene import COLORS, Scene

    by_text = {p.text: p for c in CATEGORIES for p in _cached_prompts(c)}
    names = list(COLORS)

    def generate(prompt, n, seed):
        scene = scene_for_prompt(by_text[prompt], np.random.default_rng(seed))
        if kind == "recolor":
            objs = tuple(replace(o, color=names[(names.index(o.color) + 3) % len(names)]) for o in scene.objects)
        else:
            objs = scene.objects[:1]
        return [Image.fromarray(render_scene(Scene(objs, scene.background, scene.seed), 32, 1.0))] * n

    return generate


def test_shapes_ground_truth_scores_one_and_wrong_images_drop(tmp_path):
    rows = generate_shapes_metadata(n_per_category=12, seed=0)
    assert len(rows) == 72 and all(r["world"] == "shapes" for r in rows)
    from mmspec.world.prompts import make_prompt_set

    for row, prompt in zip(rows, make_prompt_set(12, 0)):
        assert gv.metadata_to_shapes_prompt(row) == prompt  # lossless conversion

    generate_images(shapes_ground_truth_generator(), rows, tmp_path / "gt", 1, seed=0, progress=False)
    truth = summarize(evaluate_folder(tmp_path / "gt", progress=False))
    assert truth.overall == 1.0 and truth.complete and truth.num_images == 72

    generate_images(_wrong_generator("recolor"), rows, tmp_path / "recolor", 1, progress=False)
    recolor = summarize(evaluate_folder(tmp_path / "recolor", progress=False)).per_category
    for tag in ("single_object", "two_object", "counting", "position"):
        assert recolor[tag]["accuracy"] == 1.0, tag  # colour-blind categories are unaffected
    assert recolor["colors"]["accuracy"] == 0.0 and recolor["color_attr"]["accuracy"] == 0.0

    generate_images(_wrong_generator("drop"), rows, tmp_path / "drop", 1, progress=False)
    drop = summarize(evaluate_folder(tmp_path / "drop", progress=False)).per_category
    assert drop["single_object"]["accuracy"] == 1.0 and drop["colors"]["accuracy"] == 1.0
    assert drop["two_object"]["accuracy"] == 0.0 and drop["position"]["accuracy"] == 0.0
    assert drop["color_attr"]["accuracy"] == 0.0 and drop["counting"]["accuracy"] == 0.0  # counts are >= 2


def test_evaluate_reports_a_truncated_png_by_its_file_name(tmp_path):
    """A sample PNG cut short fails the evaluation naming that file (PIL's own error names none), and the
    command line writes no results file."""
    rows = generate_shapes_metadata(n_per_category=1, seed=0)[:2]
    generate_images(shapes_ground_truth_generator(), rows, tmp_path / "gt", 1, seed=0, progress=False)
    sample = sorted((tmp_path / "gt").glob("*/samples/*.png"))[1]
    data = sample.read_bytes()
    sample.write_bytes(data[: len(data) // 2])
    relative = sample.relative_to(tmp_path / "gt")
    with pytest.raises(ValueError, match=f"cannot read the image .*{relative}"):
        evaluate_folder(tmp_path / "gt", progress=False)
    with pytest.raises(ValueError, match=str(relative)):
        gv.main(["evaluate", str(tmp_path / "gt"), "--out", str(tmp_path / "r.jsonl"), "--no-progress"])
    assert not (tmp_path / "r.jsonl").exists()


def test_shapes_detector_matches_the_scene():
    from mmspec.world.prompts import make_prompt_set, scene_for_prompt
    from mmspec.world.render import render_scene

    prompt = make_prompt_set(1, 0)[5]  # a color_attr prompt
    scene = scene_for_prompt(prompt, 3)
    det = gv.ShapesDetector()(Image.fromarray(render_scene(scene, 64, 1.0)))
    assert sorted(zip(det.labels, det.colors)) == sorted((o.shape, o.color) for o in scene.objects)
    assert det.boxes.max() <= 64 and det.boxes.min() >= 0


# --------------------------------------------------------------------------------------------
# COCO folders with a pluggable detector
# --------------------------------------------------------------------------------------------


class LookupDetector:
    """Returns stored detections for known images (keyed by pixel content)."""

    def __init__(self, classes=None):
        self.table, self.classes = {}, classes

    def add(self, image, detections):
        self.table[image.tobytes()] = detections

    def __call__(self, image):
        return self.table[image.convert("RGB").tobytes()]


def _coco_folder(root, rows_and_dets, detector):
    for i, (row, dets) in enumerate(rows_and_dets):
        folder = root / f"{i:05d}"
        (folder / "samples").mkdir(parents=True)
        for k, det in enumerate(dets):
            image = Image.new("RGB", (64, 64), (i * 20, k * 30, 7))
            image.save(folder / "samples" / f"{k:04d}.png")
            detector.add(image, det)
        (folder / "metadata.jsonl").write_text(json.dumps(row) + "\n")


def test_coco_folder_evaluation_summary_and_detector_classes(tmp_path):
    rows = generate_coco_metadata()
    single = rows[0]  # bench
    counting = next(r for r in rows if r["tag"] == "counting")
    cls, k = counting["include"][0]["class"], counting["include"][0]["count"]
    good_count = {"boxes": [[i * 10, 0, i * 10 + 8, 8] for i in range(k)], "labels": [cls] * k, "scores": [0.95] * k}
    detector = LookupDetector()
    _coco_folder(tmp_path / "imgs", [
        (single, [{"boxes": [[0, 0, 10, 10]], "labels": ["bench"], "scores": [0.9]},
                  {"boxes": [[0, 0, 10, 10]], "labels": ["dog"], "scores": [0.9]}]),
        (counting, [good_count] * 3 + [{"boxes": [], "labels": [], "scores": []}]),
    ], detector)
    results = evaluate_folder(tmp_path / "imgs", detector, progress=False)
    assert [r["correct"] for r in results] == [True, False, True, True, True, False]
    assert "expected bench>=1, found 0" in results[1]["reason"]
    report = summarize(results)
    assert report.per_category["single_object"]["accuracy"] == 0.5
    assert report.per_category["counting"]["accuracy"] == 0.75
    assert report.overall == pytest.approx((0.5 + 0.75) / 2)  # mean of categories, not of images (4/6)
    assert not report.complete and report.num_prompts == 2 and report.prompt_accuracy == 1.0
    md = report.to_markdown()
    assert "| single_object | 0.5000 | 1 / 2 |" in md and "| colors | - | 0 / 0 |" in md and "**0.6250**" in md
    # A detector that cannot produce a needed class is refused before any scoring.
    with pytest.raises(ValueError, match="classes the detector does not know"):
        evaluate_folder(tmp_path / "imgs", LookupDetector(classes={"dog"}), progress=False)
    with pytest.raises(ValueError, match="detector"):
        evaluate_folder(tmp_path / "imgs", None, progress=False)


def test_transformers_detector_from_a_local_folder(tmp_path):
    import torch
    from transformers import YolosConfig, YolosForObjectDetection, YolosImageProcessor

    labels = {0: "person", 1: "dog", 2: "remote", 3: "keyboard"}
    config = YolosConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                         image_size=[64, 64], patch_size=16, num_detection_tokens=5, id2label=labels,
                         label2id={v: k for k, v in labels.items()})
    torch.manual_seed(0)
    YolosForObjectDetection(config).save_pretrained(tmp_path / "det")
    YolosImageProcessor(size={"shortest_edge": 64, "longest_edge": 64}).save_pretrained(tmp_path / "det")
    detector = gv.TransformersDetector(tmp_path / "det")
    assert detector.classes == {"person", "dog", "tv remote", "computer keyboard"}  # GenEval names
    det = detector(Image.new("RGB", (80, 60), (200, 10, 10)))
    assert det.boxes.shape == (5, 4) and len(det.labels) == 5
    assert set(det.labels) <= detector.classes and ((det.scores >= 0) & (det.scores <= 1)).all()
    with pytest.raises(FileNotFoundError, match="detector"):
        gv.TransformersDetector(tmp_path / "missing")


def test_clip_colour_classifier_returns_palette_names():
    pytest.importorskip("open_clip")
    import warnings

    from mmspec.evaluation.clip_score import CLIPScorer, register_clip_config

    register_clip_config("mmspec-test-geneval-clip", {
        "embed_dim": 16, "vision_cfg": {"image_size": 32, "layers": 1, "width": 16, "head_width": 8, "patch_size": 8},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clf = gv.CLIPColorClassifier(CLIPScorer("mmspec-test-geneval-clip", None))
    img = Image.new("RGB", (64, 64), (200, 20, 20))
    colors = clf(img, np.array([[0, 0, 32, 32], [10, 10, 60, 60]]), "car")
    assert len(colors) == 2 and set(colors) <= set(gv.COCO_COLORS)
    assert clf._classifier("car").shape == (10, 16)


# --------------------------------------------------------------------------------------------
# Sharding across processes
# --------------------------------------------------------------------------------------------


def test_process_index_sources(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "accelerate", None)  # accelerate "not installed"
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed.process_index_and_count() == (0, 1)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert distributed.process_index_and_count() == (2, 3)
    assert distributed.shard(list("abcdefg")) == ["c", "f"]
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ValueError, match="RANK=3"):
        distributed.process_index_and_count()
    parts = [distributed.shard_indices(10, i, 3) for i in range(3)]
    assert sorted(sum(parts, [])) == list(range(10))
    with pytest.raises(ValueError, match="index"):
        distributed.shard_indices(5, 3, 3)


def test_accelerate_partial_state_is_used_when_present(monkeypatch):
    class FakeState:  # what accelerate's PartialState reports under `accelerate launch` on 4 GPUs
        process_index, num_processes = 3, 4

    monkeypatch.setitem(__import__("sys").modules, "accelerate", type("M", (), {"PartialState": FakeState}))
    monkeypatch.setenv("RANK", "0")  # accelerate wins over the raw environment variables
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert distributed.process_index_and_count() == (3, 4)
    assert distributed.shard(list(range(10))) == [3, 7]
    assert not distributed.is_main_process()


def test_sharded_generation_equals_single_process(tmp_path, monkeypatch):
    rows = generate_shapes_metadata(n_per_category=2, seed=1)
    monkeypatch.setitem(__import__("sys").modules, "accelerate", None)
    generate = shapes_ground_truth_generator()
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    single = generate_images(generate, rows, tmp_path / "single", 2, progress=False)
    handled = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        handled.append(generate_images(generate, rows, tmp_path / "shard", 2, progress=False))
    assert sorted(handled[0] + handled[1]) == single == list(range(12)) and not set(handled[0]) & set(handled[1])
    for i in range(12):
        for k in range(2):
            a = (tmp_path / "single" / f"{i:05d}" / "samples" / f"{k:04d}.png").read_bytes()
            assert a == (tmp_path / "shard" / f"{i:05d}" / "samples" / f"{k:04d}.png").read_bytes()


def test_interrupted_generation_is_resumed(tmp_path):
    rows = generate_shapes_metadata(n_per_category=1, seed=0)
    calls = []

    def flaky(prompt, n, seed):
        calls.append(prompt)
        if len(calls) == 3:
            raise RuntimeError("crash")
        return shapes_ground_truth_generator()(prompt, n, seed)

    with pytest.raises(RuntimeError, match="crash"):
        generate_images(flaky, rows, tmp_path / "out", 1, progress=False)
    assert (tmp_path / "out" / "00001" / "metadata.jsonl").exists()
    assert not (tmp_path / "out" / "00002").exists()  # nothing half-written for the failed prompt
    with pytest.raises(ValueError, match="incomplete generation|no prompt folders|metadata"):
        (tmp_path / "out" / "00002" / "samples").mkdir(parents=True)
        evaluate_folder(tmp_path / "out", progress=False)
    generate_images(flaky, rows, tmp_path / "out", 1, progress=False)
    assert len(calls) == 3 + 4  # only the missing prompts were generated again
    assert summarize(evaluate_folder(tmp_path / "out", progress=False)).overall == 1.0


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["--n-per-category", "--images-per-prompt"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_cli_counts_below_one_are_refused_before_anything_is_written(option, value, tmp_path, capsys):
    """A count of zero prompts or images would write an empty prompt file or an empty layout: argparse refuses it,
    naming the option, and writes nothing."""
    command = "prompts" if option == "--n-per-category" else "generate"
    args = ["--world", "shapes", "--out", str(tmp_path / "p.jsonl")] if command == "prompts" else \
        ["--world", "shapes", "--ground-truth", "--outdir", str(tmp_path / "gt")]
    with pytest.raises(SystemExit) as caught:
        gv.main([command, *args, option, value])
    assert caught.value.code == 2
    assert f"argument {option}: must be >= 1" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_cli_prompts_generate_evaluate_summary(tmp_path, capsys):
    coco = tmp_path / "coco.jsonl"
    assert gv.main(["prompts", "--world", "coco", "--out", str(coco)]) == 0
    assert len(load_metadata(coco)) == 553
    shapes = tmp_path / "shapes.jsonl"
    assert gv.main(["prompts", "--world", "shapes", "--n-per-category", "3", "--out", str(shapes)]) == 0
    assert gv.main(["generate", "--metadata", str(shapes), "--ground-truth", "--outdir", str(tmp_path / "gt"),
                    "--no-progress"]) == 0
    results, summary = tmp_path / "results.jsonl", tmp_path / "summary.json"
    assert gv.main(["evaluate", str(tmp_path / "gt"), "--out", str(results), "--summary", str(summary), "--no-progress"]) == 0
    assert json.loads(summary.read_text())["overall"] == 1.0
    assert len(results.read_text().splitlines()) == 18
    capsys.readouterr()
    assert gv.main(["summary", str(results)]) == 0
    assert "| **overall** (mean of categories) | **1.0000** |" in capsys.readouterr().out
    # Bad input: a metadata file with an unknown category; nothing is written.
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"tag": "spatial", "include": [{"class": "dog"}], "prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="unknown category"):
        gv.main(["generate", "--metadata", str(bad), "--ground-truth", "--outdir", str(tmp_path / "never"), "--no-progress"])
    assert not (tmp_path / "never").exists()
    with pytest.raises(ValueError, match="detector"):  # COCO prompts without a detector
        gv.main(["evaluate", str(_one_coco_folder(tmp_path)), "--out", str(tmp_path / "r.jsonl"), "--no-progress"])
    assert not (tmp_path / "r.jsonl").exists()
    out = tmp_path / "nothing.jsonl"
    with pytest.raises(FileNotFoundError):
        gv.main(["evaluate", str(tmp_path / "missing"), "--out", str(out), "--no-progress"])
    assert not out.exists()


def _one_coco_folder(tmp_path):
    folder = tmp_path / "coco_imgs" / "00000"
    (folder / "samples").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(folder / "samples" / "0000.png")
    (folder / "metadata.jsonl").write_text(json.dumps(generate_coco_metadata()[0]) + "\n")
    return tmp_path / "coco_imgs"


def test_generate_with_a_pipeline_writes_the_geneval_layout(tmp_path):
    """`generate --pipeline` drives ARImagePipeline (a tiny random one over the shapes vocabulary)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_shapes_pipeline import save_tiny_shapes_pipeline

    folder = save_tiny_shapes_pipeline(tmp_path / "pipe")
    metadata = gv.write_metadata(tmp_path / "meta.jsonl", gv.generate_shapes_metadata(n_per_category=1)[:2])
    code = gv.main(["generate", "--metadata", str(metadata), "--pipeline", str(folder), "--method", "eagle",
                    "--images-per-prompt", "2", "--outdir", str(tmp_path / "o"), "--no-progress"])
    assert code == 0
    prompts = sorted((tmp_path / "o").iterdir())
    assert len(prompts) == 2
    for prompt in prompts:
        samples = sorted((prompt / "samples").iterdir())
        assert len(samples) == 2 and Image.open(samples[0]).size == (32, 32)
        assert (prompt / "metadata.jsonl").is_file()
