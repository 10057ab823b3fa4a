"""The VLM drafter recipe (models/recipes/train_vlm_drafter.py) on a tiny random shapes captioner: each
method trains a few steps, logs loss and held-out acceptance, resumes, and saves a head that loads,
binds to the target and drafts losslessly; a JSON-lines data file (the real-checkpoint path) works too."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from mmspec.models import shapes_vlm as sv
from mmspec.models.recipes import train_vlm_drafter as recipe

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SMALL = ["--steps", "4", "--batch", "2", "--train-images", "6", "--train-videos", "2", "--held-out", "2",
         "--eval-every", "2", "--eval-tokens", "6", "--save-every", "2", "--num-latents", "4", "--threads", "1"]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_shapes_vlm")
    sv.build_model("tiny", seed=0).save_pretrained(folder)
    sv.build_processor().save_pretrained(folder)
    return folder


def _log(work):
    return [json.loads(line) for line in (work / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", ["eagle", "flash", "vispec", "specvlm"])
def test_each_method_trains_logs_and_saves(tiny_target, tmp_path, method):
    work, out = tmp_path / "work", tmp_path / "head"
    recipe.main(["--method", method, "--target", str(tiny_target), "--out", str(out), "--work", str(work), *SMALL])
    evals = [entry["eval"] for entry in _log(work) if "eval" in entry]
    assert len(evals) == 2  # steps 2 and 4
    for e in evals:
        assert 0.0 <= e["top1"] <= 1.0
        assert e["mean_accepted_length"] >= 1.0  # the bonus token counts
    head = recipe.HEADS[method].from_pretrained(out)
    target = sv.load_model(tiny_target)
    head.bind_target(target)  # the saved head fits its target


def test_resume_continues_the_same_run(tiny_target, tmp_path):
    args = ["--method", "eagle", "--target", str(tiny_target), "--threads", "1"]
    small = [a for a in SMALL if a != "--threads"][:-1]
    straight, resumed = tmp_path / "a", tmp_path / "b"
    recipe.main([*args, "--out", str(straight / "head"), "--work", str(straight), *small])
    stop_early = [v if prev != "--steps" else "2" for prev, v in zip([""] + small, small)]
    recipe.main([*args, "--out", str(resumed / "head"), "--work", str(resumed), *stop_early])
    recipe.main([*args, "--out", str(resumed / "head"), "--work", str(resumed), *small])
    a = recipe.HEADS["eagle"].from_pretrained(straight / "head").state_dict()
    b = recipe.HEADS["eagle"].from_pretrained(resumed / "head").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_jsonl_pairs_train_a_head(tiny_target, tmp_path):
    rng = np.random.default_rng(0)
    lines = []
    for i in range(5):
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
        lines.append({"images": [f"{i}.png"], "prompt": "user: <image> describe the image in detail. assistant:",
                      "answer": "the image shows one shape on a dark background."})
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(line) for line in lines))
    work = tmp_path / "work"
    recipe.main(["--method", "vispec", "--target", str(tiny_target), "--out", str(tmp_path / "head"),
                 "--work", str(work), "--data", str(data), *SMALL])
    assert any("eval" in entry for entry in _log(work))


def test_jsonl_errors(tiny_target, tmp_path):
    base = ["--method", "eagle", "--target", str(tiny_target), "--out", str(tmp_path / "h"), "--work",
            str(tmp_path / "w"), *SMALL]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        recipe.main([*base, "--data", str(tmp_path / "missing.jsonl")])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"images": ["x.png"], "prompt": "p"}) + "\n")
    with pytest.raises(ValueError, match="lacks"):
        recipe.main([*base, "--data", str(bad)])


def test_several_methods_share_teacher_forwards(tiny_target, tmp_path):
    """One run trains several heads (one teacher forward per step): each lands in its component folder,
    loads and binds; each head's eval is logged; per-head clipping keeps the heads independent (a head
    trained alone and in the set start from the same weights and move)."""
    work, out = tmp_path / "work", tmp_path / "pipe"
    recipe.main(["--method", "eagle", "specvlm", "--target", str(tiny_target), "--out", str(out), "--work", str(work),
                 *SMALL])
    evals = [entry["eval"] for entry in _log(work) if "eval" in entry]
    assert len(evals) == 2 and all(set(e) == {"eagle", "specvlm"} for e in evals)
    assert all(e[m]["mean_accepted_length"] >= 1.0 for e in evals for m in e)
    target = sv.load_model(tiny_target)
    for method in ("eagle", "specvlm"):
        head = recipe.HEADS[method].from_pretrained(out / recipe.COMPONENTS[method])
        head.bind_target(target)
    assert not (out / "config.json").exists()  # nothing written at the pipeline folder's top level


def test_head_set_clips_each_head_on_its_own():
    small, large = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    heads = recipe.HeadSet({"a": small, "b": large})
    for p in small.parameters():
        p.grad = torch.full_like(p, 0.01)
    for p in large.parameters():
        p.grad = torch.full_like(p, 100.0)
    heads.clip_gradients(1.0)
    assert torch.allclose(small.weight.grad, torch.full_like(small.weight, 0.01))  # untouched by the other's norm
    total = torch.sqrt(sum((p.grad ** 2).sum() for p in large.parameters()))
    assert abs(total.item() - 1.0) < 1e-4


def test_init_starts_from_trained_heads(tiny_target, tmp_path):
    """--init loads trained heads (a pipeline folder for several methods, the head's folder for one): with a
    zero learning rate the saved heads are the loaded ones; a missing folder or another head class is
    refused with a clear error."""
    first = tmp_path / "first"
    recipe.main(["--method", "eagle", "flash", "--target", str(tiny_target), "--out", str(first), "--work",
                 str(tmp_path / "w1"), *SMALL])
    again = tmp_path / "again"
    recipe.main(["--method", "eagle", "flash", "--target", str(tiny_target), "--out", str(again), "--work",
                 str(tmp_path / "w2"), "--init", str(first), *SMALL, "--lr", "0"])
    for method in ("eagle", "flash"):
        a = recipe.HEADS[method].from_pretrained(first / recipe.COMPONENTS[method]).state_dict()
        b = recipe.HEADS[method].from_pretrained(again / recipe.COMPONENTS[method]).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    fresh = recipe.build_head("eagle", sv.load_model(tiny_target), recipe.build_parser().parse_args(
        ["--method", "eagle", "--target", "t", "--out", "o", "--seed", "1"])).state_dict()
    trained = recipe.HEADS["eagle"].from_pretrained(first / "eagle_head").state_dict()
    assert any(not torch.equal(fresh[k], trained[k].float()) for k in fresh)  # init is not a fresh head
    single = ["--target", str(tiny_target), "--out", str(tmp_path / "h"), "--work", str(tmp_path / "w3"), *SMALL]
    recipe.main(["--method", "eagle", "--init", str(first / "eagle_head"), *single])
    with pytest.raises(ValueError, match="class EagleVLMHead, not FlashHead"):
        recipe.main(["--method", "flash", "--init", str(first / "eagle_head"), *single])
    with pytest.raises(FileNotFoundError, match="no trained eagle head"):
        recipe.main(["--method", "eagle", "--init", str(tmp_path / "missing"), *single])
