"""mmspec.world.parallel and the recipes' --data-workers: a training set built in worker processes equals the
one built in a single process, bit for bit."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from mmspec.models.recipes import common
from mmspec.models.recipes.train_mar import build_data as build_mar_data
from mmspec.models.recipes.train_t2i import build_data as build_t2i_data
from mmspec.models.recipes.train_video import build_data as build_video_data
from mmspec.models.text import WordTokenizer
from mmspec.models.tokenizers import ContinuousTokenizer, VQTokenizer, zoo_tokenizer_path
from mmspec.world import vocabulary
from mmspec.world.parallel import build_in_parts, concat_parts, part_bounds


def _numbered(first: int, count: int, *, scale: int) -> dict:
    """A part that records which samples it built (and in which process)."""
    import os

    index = list(range(first, first + count))
    return {"values": torch.tensor(index) * scale, "array": np.array(index), "items": index, "pid": [os.getpid()]}


def test_part_bounds_cover_the_range_in_order():
    for total, parts, align in ((10, 3, 1), (10, 4, 3), (7, 7, 1), (3, 8, 1), (1000, 5, 500), (0, 4, 1)):
        bounds = part_bounds(total, parts, align)
        assert bounds[0][0] == 0 and sum(count for _, count in bounds) == total
        assert all(a + n == b for (a, n), (b, _) in zip(bounds, bounds[1:]))  # contiguous, in order
        assert all(first % align == 0 for first, _ in bounds)
        assert len(bounds) <= max(1, parts) and (total == 0 or all(count > 0 for _, count in bounds))
    assert part_bounds(10, 3) == [(0, 4), (4, 3), (7, 3)]
    assert part_bounds(1200, 2, align=500) == [(0, 1000), (1000, 200)]
    for bad in (dict(total=-1, parts=2), dict(total=5, parts=0), dict(total=5, parts=2, align=0),
                dict(total=2.5, parts=2), dict(total=5, parts=True)):
        with pytest.raises(ValueError):
            part_bounds(**bad)


def test_build_in_parts_runs_slices_in_processes_and_keeps_their_order():
    one = build_in_parts(partial(_numbered, scale=3), 11, workers=1)
    assert len(one) == 1
    parts = build_in_parts(partial(_numbered, scale=3), 11, workers=3)
    assert len(parts) == 6 and len({part["pid"][0] for part in parts} - {one[0]["pid"][0]}) >= 1  # other processes
    merged, single = concat_parts(parts), concat_parts(one)
    assert torch.equal(merged["values"], single["values"]) and merged["items"] == list(range(11))
    assert np.array_equal(merged["array"], np.arange(11))
    with pytest.raises(ValueError, match="data workers must be a positive integer"):
        build_in_parts(partial(_numbered, scale=1), 4, workers=0)
    with pytest.raises(TypeError, match="cannot merge 'x' of type str"):
        concat_parts([{"x": "a"}])
    with pytest.raises(ValueError, match="at least one part"):
        concat_parts([])


def test_vlm_training_set_is_the_same_for_any_number_of_workers():
    import mmspec.models.shapes_vlm as sv

    one = sv.build_training_set(13, 5, seed=3, duplicate_fraction=0.3)
    three = sv.build_training_set(13, 5, seed=3, duplicate_fraction=0.3, workers=3)
    assert one.keys() == three.keys()
    for key in ("images", "videos", "patch_classes", "patch_offsets"):
        assert torch.equal(one[key], three[key]), key
    assert one["examples"] == three["examples"]
    assert [e["ref"] for e in three["examples"] if not e["video"]][-1] == 12  # global scene indices
    assert {e["task"] for e in three["examples"]} == {"describe", "caption", "qa", "narrate", "video_caption"}
    empty = sv.build_training_set(0, 2, workers=2)
    assert empty["images"].shape[0] == 0 and empty["patch_classes"].shape[0] == 2 * sv.VIDEO_FRAMES


def test_video_clips_are_the_same_for_any_number_of_workers():
    tokenizer = ContinuousTokenizer.from_pretrained(str(zoo_tokenizer_path("continuous"))).eval()
    words = WordTokenizer(vocabulary())
    args = (5, 2, tokenizer, words, 24, 16, 0.5)
    one = build_video_data(*args, first_index=7, render_frames=2)
    two = build_video_data(*args, first_index=7, render_frames=2, workers=2)
    assert one["latents"].shape[:2] == (5, 2) and one["captions"] == two["captions"]
    assert torch.equal(one["latents"], two["latents"]) and torch.equal(one["words"], two["words"])


def test_image_sets_are_encoded_in_the_same_batches_for_any_number_of_workers(monkeypatch):
    monkeypatch.setattr(common, "ENCODE_BATCH", 4)  # several batches from a few images (the workers are forked)
    words = WordTokenizer(vocabulary())
    vq = VQTokenizer.from_pretrained(str(common.DEFAULT_VQ))
    one, two = (build_t2i_data(10, 1, vq, words, 16, 0.5, workers=w) for w in (1, 2))
    assert one["tokens"].shape == (10, 64) and one["captions"] == two["captions"]
    assert torch.equal(one["tokens"], two["tokens"]) and torch.equal(one["words"], two["words"])
    continuous = ContinuousTokenizer.from_pretrained(str(zoo_tokenizer_path("continuous"))).eval()
    one, three = (build_mar_data(9, 2, continuous, words, 16, 0.5, workers=w) for w in (1, 3))
    assert one["tokens"].dtype == torch.float16 and one["captions"] == three["captions"]
    assert torch.equal(one["tokens"], three["tokens"])


def test_recipes_refuse_a_bad_worker_count():
    import argparse

    parser = argparse.ArgumentParser()
    common.add_data_workers_argument(parser)
    assert parser.parse_args(["--data-workers", "3"]).data_workers == 3
    assert parser.parse_args([]).data_workers == 1
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--data-workers", bad])
