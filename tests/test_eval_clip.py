"""CLIP score on a tiny random-weight open_clip model (registered config, weights from a local file)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from PIL import Image

pytest.importorskip("open_clip")

from mmspec.evaluation import clip_score as cs  # noqa: E402
from mmspec.evaluation.clip_score import CLIPScorer, compute_clip_score, register_clip_config  # noqa: E402

TINY = "mmspec-test-tiny-clip"
TINY_CONFIG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}
PROMPTS = ["a red circle", "a blue square", "two green triangles", "a white diamond"]
COLORS = [(230, 30, 30), (40, 80, 240), (40, 190, 60), (235, 235, 235)]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    register_clip_config(TINY, TINY_CONFIG)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scorer = CLIPScorer(TINY, None)
    path = tmp_path_factory.mktemp("clip") / "tiny_clip.pt"
    torch.save(scorer.model.state_dict(), path)
    return path


@pytest.fixture(scope="module")
def scorer(weights):
    return CLIPScorer(TINY, weights)


def _images():
    return [Image.new("RGB", (32, 32), c) for c in COLORS]


def test_scores_are_100_times_clamped_cosine(scorer):
    images = _images()
    scores = scorer.score(images, PROMPTS, batch_size=3)
    assert scores.shape == (4,)
    with torch.no_grad():
        pixels = torch.stack([scorer.preprocess(im) for im in images])
        img = scorer.model.encode_image(pixels)
        txt = scorer.model.encode_text(scorer.tokenizer(PROMPTS))
        cos = torch.nn.functional.cosine_similarity(img, txt, dim=-1)
    assert torch.allclose(scores, 100 * cos.clamp_min(0), atol=1e-4)
    assert ((scores >= 0) & (scores <= 100)).all()
    # The similarity depends on both the image and the prompt.
    sim = scorer.embed_images(images) @ scorer.embed_texts(PROMPTS).T  # [4 images, 4 prompts]
    assert sim.std(dim=0).min() > 1e-4 and sim.std(dim=1).min() > 1e-4
    assert torch.allclose(scores, 100 * torch.diagonal(sim).clamp_min(0), atol=1e-4)
    assert torch.allclose(scorer.score(images, PROMPTS, batch_size=1), scores, atol=1e-4)


def test_weights_come_from_the_file(weights, scorer):
    torch.manual_seed(123)  # a different random init must be overwritten by the file
    again = CLIPScorer(TINY, weights)
    images = _images()
    assert torch.equal(again.score(images, PROMPTS), scorer.score(images, PROMPTS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        random_model = CLIPScorer(TINY, None)
    assert not torch.allclose(random_model.score(images, PROMPTS), scorer.score(images, PROMPTS))


def test_folder_layouts_and_cli(tmp_path, weights, scorer, capsys):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i, image in enumerate(_images()):
        image.save(folder / f"{i:02d}.png")
    expected = scorer.score(_images(), PROMPTS).mean().item()

    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    res_txt = compute_clip_score(folder, tmp_path / "prompts.txt", scorer=scorer)
    assert res_txt.clip_score == pytest.approx(expected, rel=1e-5) and res_txt.num_pairs == 4

    rows = [{"file": f"{i:02d}.png", "prompt": p} for i, p in enumerate(PROMPTS)]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res_default = compute_clip_score(folder, scorer=scorer)  # folder/prompts.jsonl
    assert res_default.clip_score == pytest.approx(expected, rel=1e-5)

    geneval = tmp_path / "geneval"
    for i, (image, prompt) in enumerate(zip(_images(), PROMPTS)):
        (geneval / f"{i:05d}" / "samples").mkdir(parents=True)
        image.save(geneval / f"{i:05d}" / "samples" / "0000.png")
        (geneval / f"{i:05d}" / "metadata.jsonl").write_text(json.dumps({"tag": "colors", "prompt": prompt}) + "\n")
    assert compute_clip_score(geneval, scorer=scorer).clip_score == pytest.approx(expected, rel=1e-5)

    out, per = tmp_path / "clip.json", tmp_path / "per.jsonl"
    assert cs.main([str(folder), "--model", TINY, "--pretrained", str(weights), "--output", str(out),
                    "--per-image", str(per), "--no-progress"]) == 0
    data = json.loads(out.read_text())
    assert data["clip_score"] == pytest.approx(expected, rel=1e-5) and data["model"] == TINY
    assert len(per.read_text().splitlines()) == 4
    assert "CLIP score" in capsys.readouterr().out


def test_bad_input(tmp_path, weights, scorer):
    with pytest.raises(FileNotFoundError, match="pretrained"):
        CLIPScorer(TINY, tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="unknown open_clip architecture"):
        CLIPScorer("no-such-clip", weights)
    with pytest.raises(RuntimeError, match="local checkpoint file"):
        CLIPScorer(TINY, "openai")  # a pretrained tag that is not available offline
    with pytest.raises(ValueError, match="differ in length"):
        scorer.score(_images(), PROMPTS[:2])
    folder = tmp_path / "imgs"
    folder.mkdir()
    _images()[0].save(folder / "a.png")
    _images()[1].save(folder / "b.png")
    (tmp_path / "three.txt").write_text("a\nb\nc\n")
    with pytest.raises(ValueError, match="3 prompts but"):
        compute_clip_score(folder, tmp_path / "three.txt", scorer=scorer)
    with pytest.raises(FileNotFoundError, match="prompts"):
        compute_clip_score(folder, tmp_path / "none.txt", scorer=scorer)
    with pytest.raises(ValueError, match="neither prompts.jsonl"):
        compute_clip_score(folder, scorer=scorer)
    with pytest.raises(SystemExit):
        cs.main([str(folder), "--model", TINY])  # no weights given: refused
    out = tmp_path / "o.json"
    with pytest.raises(ValueError):
        cs.main([str(folder), "--prompts", str(tmp_path / "three.txt"), "--model", TINY,
                 "--pretrained", str(weights), "--output", str(out), "--no-progress"])
    assert not out.exists()
    # a truncated PNG is reported by its name (PIL's own error names no file)
    data = (folder / "b.png").read_bytes()
    (folder / "b.png").write_bytes(data[: len(data) // 2])
    (tmp_path / "two.txt").write_text("a\nb\n")
    with pytest.raises(ValueError, match=r"cannot read the image .*imgs/b\.png"):
        compute_clip_score(folder, tmp_path / "two.txt", scorer=scorer)


def test_register_clip_config_leaves_no_temporary_files(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where TemporaryDirectory creates its folder
    register_clip_config("mmspec-tiny-clip-tempcheck", TINY_CONFIG)
    import open_clip

    assert "mmspec-tiny-clip-tempcheck" in open_clip.list_models()
    assert list(tmp_path.iterdir()) == []
