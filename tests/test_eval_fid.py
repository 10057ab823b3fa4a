"""FID: the Frechet distance against closed forms, the pipeline from images, the shapes feature network,
the torchmetrics cross-check, bad input and atomic outputs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from mmspec.evaluation import fid as fidmod
from mmspec.evaluation.fid import (
    compute_fid,
    extract_features,
    feature_statistics,
    frechet_distance,
    load_feature_extractor,
    save_statistics,
)


def _random_spd(rng: np.random.Generator, d: int) -> np.ndarray:
    a = rng.normal(size=(d, d))
    return a @ a.T / d + 0.1 * np.eye(d)


# --------------------------------------------------------------------------------------------
# The distance
# --------------------------------------------------------------------------------------------


def test_frechet_distance_diagonal_gaussians_closed_form():
    # For commuting (diagonal) covariances: ||mu1-mu2||^2 + sum_i (sqrt(a_i) - sqrt(b_i))^2.
    mu1, mu2 = np.array([0.0, 1.0, -2.0]), np.array([1.0, 1.0, 0.5])
    a, b = np.array([1.0, 4.0, 0.25]), np.array([9.0, 1.0, 0.25])
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    assert frechet_distance(mu1, np.diag(a), mu2, np.diag(b)) == pytest.approx(expected, rel=1e-12)


def test_frechet_distance_general_covariances_match_sqrtm_and_properties():
    from scipy.linalg import sqrtm

    rng = np.random.default_rng(0)
    d = 6
    s1, s2 = _random_spd(rng, d), _random_spd(rng, d)
    mu1, mu2 = rng.normal(size=d), rng.normal(size=d)
    reference = np.sum((mu1 - mu2) ** 2) + np.trace(s1 + s2 - 2 * np.real(sqrtm(s1 @ s2)))
    value = frechet_distance(mu1, s1, mu2, s2)
    assert value == pytest.approx(reference, rel=1e-9)
    assert frechet_distance(mu2, s2, mu1, s1) == pytest.approx(value, rel=1e-9)  # symmetric
    assert frechet_distance(mu1, s1, mu1, s1) == pytest.approx(0.0, abs=1e-9)  # zero on equal inputs
    # Scaling a covariance by c^2 scales its square root by c: 1-D check of the trace term.
    assert frechet_distance([0.0], [[4.0]], [0.0], [[1.0]]) == pytest.approx((2 - 1) ** 2)


def test_sample_estimate_converges_to_closed_form():
    rng = np.random.default_rng(1)
    d, n = 4, 40000
    s1, s2 = _random_spd(rng, d), _random_spd(rng, d)
    mu1, mu2 = np.zeros(d), np.full(d, 0.5)
    x = rng.multivariate_normal(mu1, s1, size=n)
    y = rng.multivariate_normal(mu2, s2, size=n)
    exact = frechet_distance(mu1, s1, mu2, s2)
    estimate = frechet_distance(*feature_statistics(x), *feature_statistics(y))
    assert estimate == pytest.approx(exact, rel=0.05)


def test_frechet_distance_rejects_bad_shapes():
    with pytest.raises(ValueError, match="mu1 and mu2"):
        frechet_distance(np.zeros(3), np.eye(3), np.zeros(2), np.eye(2))
    with pytest.raises(ValueError, match="sigma2"):
        frechet_distance(np.zeros(3), np.eye(3), np.zeros(3), np.eye(2))
    with pytest.raises(ValueError, match="at least 2 images"):
        feature_statistics(np.zeros((1, 3)))


# --------------------------------------------------------------------------------------------
# From images, with a custom extractor
# --------------------------------------------------------------------------------------------


class MeanColor(nn.Module):
    """Features = mean RGB of the image (0-255 scale): 3 features, torchmetrics-style module."""

    num_features = 3

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return images.float().mean(dim=(2, 3))


def _flat_images(rng, mu, std, n, size=4):
    colors = np.clip(np.rint(rng.normal(mu, std, size=(n, 3))), 0, 255).astype(np.uint8)
    return torch.from_numpy(colors)[:, :, None, None].expand(n, 3, size, size).contiguous()


def test_compute_fid_from_images_matches_gaussian_closed_form():
    rng = np.random.default_rng(2)
    real = _flat_images(rng, [100, 120, 140], [20, 10, 5], 6000)
    fake = _flat_images(rng, [110, 120, 130], [10, 10, 10], 6000)
    result = compute_fid(real, fake, MeanColor())
    exact = frechet_distance([100, 120, 140], np.diag([400.0, 100, 25]), [110, 120, 130], np.diag([100.0, 100, 100]))
    assert result.fid == pytest.approx(exact, rel=0.05)
    assert (result.num_real, result.num_fake, result.num_features) == (6000, 6000, 3)
    assert compute_fid(real, real, MeanColor()).fid == pytest.approx(0.0, abs=1e-6)


def test_matches_torchmetrics_with_the_same_feature_module():
    tm_fid = pytest.importorskip("torchmetrics.image.fid")
    rng = np.random.default_rng(3)
    real = _flat_images(rng, [90, 100, 110], [15, 12, 9], 500)
    fake = _flat_images(rng, [95, 100, 100], [10, 14, 9], 400)
    metric = tm_fid.FrechetInceptionDistance(feature=MeanColor())
    metric.update(real, real=True)
    metric.update(fake, real=False)
    ours = compute_fid(real, fake, MeanColor()).fid
    assert ours == pytest.approx(float(metric.compute()), rel=1e-3)


def test_folders_statistics_files_and_cli(tmp_path, capsys):
    rng = np.random.default_rng(4)
    for name, mu in (("real", 100), ("fake", 130)):
        (tmp_path / name).mkdir()
        for i, img in enumerate(_flat_images(rng, [mu] * 3, [10] * 3, 12, size=8)):
            Image.fromarray(img.permute(1, 2, 0).numpy()).save(tmp_path / name / f"{i:03d}.png")
    direct = compute_fid(tmp_path / "real", tmp_path / "fake", MeanColor(), batch_size=5)
    assert direct.fid > 1000  # means 30 apart on 3 channels: at least 3 * 30^2 minus covariance terms
    stats = tmp_path / "real.npz"
    feats = extract_features(tmp_path / "real", MeanColor(), batch_size=5)
    save_statistics(stats, *feature_statistics(feats), features="MeanColor")
    from_stats = compute_fid(stats, tmp_path / "fake", MeanColor())
    assert from_stats.fid == pytest.approx(direct.fid, rel=1e-9)
    assert from_stats.num_real is None

    # The command line, with the shapes extractor (committed weights) and a JSON output.
    out = tmp_path / "fid.json"
    assert fidmod.main([str(tmp_path / "real"), str(tmp_path / "fake"), "--output", str(out), "--no-progress"]) == 0
    data = json.loads(out.read_text())
    assert data["features"] == "shapes" and data["num_features"] == 128 and data["fid"] > 0
    assert "FID (shapes features" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# Bad input: clear errors, nothing half-written
# --------------------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "mixed").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "mixed" / "a.png")
    Image.new("RGB", (16, 8)).save(tmp_path / "mixed" / "b.png")
    (tmp_path / "ok").mkdir()
    for i in range(3):
        Image.new("RGB", (8, 8), (i * 50, 0, 0)).save(tmp_path / "ok" / f"{i}.png")
    with pytest.raises(ValueError, match="real: no images"):
        compute_fid(tmp_path / "empty", tmp_path / "ok", MeanColor())
    with pytest.raises(ValueError, match="fake: images of mixed sizes"):
        compute_fid(tmp_path / "ok", tmp_path / "mixed", MeanColor())
    with pytest.raises(FileNotFoundError, match="real: no such folder"):
        compute_fid(tmp_path / "missing", tmp_path / "ok", MeanColor())
    with pytest.raises(FileNotFoundError, match="weights"):
        load_feature_extractor("inception", tmp_path / "missing.pth")
    with pytest.raises(ValueError, match="weights"):
        load_feature_extractor("inception", None)
    with pytest.raises(FileNotFoundError, match="weights"):
        load_feature_extractor("shapes", tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="features must be one of"):
        load_feature_extractor("vgg")
    with pytest.raises(ValueError, match="num_features"):
        load_feature_extractor(nn.Identity())


def test_a_truncated_png_is_reported_by_its_file_name(tmp_path):
    """A PNG cut short (a killed writer outside mmspec's atomic writes) fails with the file's name, not PIL's
    bare "image file is truncated", and the command line writes nothing."""
    (tmp_path / "ok").mkdir()
    for i in range(3):
        Image.new("RGB", (8, 8), (i * 50, 0, 0)).save(tmp_path / "ok" / f"{i}.png")
    (tmp_path / "cut").mkdir()
    for i in range(3):
        Image.effect_noise((64, 64), 50).convert("RGB").save(tmp_path / "cut" / f"{i}.png")
    data = (tmp_path / "cut" / "1.png").read_bytes()
    (tmp_path / "cut" / "1.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cannot read the image .*cut/1\.png.*truncated"):
        compute_fid(tmp_path / "ok", tmp_path / "cut", MeanColor())
    out = tmp_path / "fid.json"
    with pytest.raises(ValueError, match=r"cut/1\.png"):
        fidmod.main([str(tmp_path / "ok"), str(tmp_path / "cut"), "--output", str(out), "--no-progress"])
    assert not out.exists()


def test_cli_failure_leaves_no_output(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "ok").mkdir()
    for i in range(3):
        Image.new("RGB", (8, 8), (i * 50, 0, 0)).save(tmp_path / "ok" / f"{i}.png")
    out = tmp_path / "res" / "fid.json"
    with pytest.raises(ValueError, match="fake: no images"):
        fidmod.main([str(tmp_path / "ok"), str(tmp_path / "empty"), "--output", str(out), "--no-progress"])
    assert not out.exists()
    assert not out.parent.exists() or not any(out.parent.iterdir())  # no temporary files left


# --------------------------------------------------------------------------------------------
# The shapes feature network
# --------------------------------------------------------------------------------------------


def _world_images(seed: int, n: int, recolor: dict | None = None, difficulty: float = 1.0) -> torch.Tensor:
    from dataclasses import replace

    from mmspec.world.render import render_scene
    from mmspec.world.scene import Scene, rng_for, sample_scene

    out = []
    for i in range(n):
        scene = sample_scene(rng_for("test", seed, i))
        if recolor:
            scene = Scene(tuple(replace(o, color=recolor.get(o.color, o.color)) for o in scene.objects),
                          scene.background, scene.seed)
        out.append(render_scene(scene, 32, difficulty))
    return torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2).contiguous()


def test_shapes_features_separate_matching_from_shifted_distributions():
    net = load_feature_extractor("shapes")
    assert net.num_features == 128
    real_a, real_b = _world_images(1, 400), _world_images(2, 400)
    # A generator that confuses colours: every red object drawn blue, every green one yellow.
    wrong = _world_images(3, 400, recolor={"red": "blue", "green": "yellow", "purple": "pink"})
    same = compute_fid(real_a, real_b, net).fid
    shifted = compute_fid(real_a, wrong, net).fid
    assert shifted > 2 * same, (same, shifted)
    feats = extract_features(real_a[:7], net)
    assert feats.shape == (7, 128) and np.isfinite(feats).all()
    # Other image sizes are resized inside the network.
    big = torch.nn.functional.interpolate(real_a[:4].float(), size=64, mode="nearest").to(torch.uint8)
    assert extract_features(big, net).shape == (4, 128)


def test_shapes_feature_training_is_deterministic(tmp_path):
    from mmspec.evaluation.shapes_features import (
        TrainConfig,
        load_shapes_features,
        save_shapes_features,
        train,
    )

    cfg = TrainConfig(num_train=128, num_val=64, epochs=1, batch_size=64)
    m1, info1 = train(cfg, progress=False)
    m2, info2 = train(cfg, progress=False)
    for (k, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), k
    assert info1["val_metrics"] == info2["val_metrics"]
    path = save_shapes_features(m1, tmp_path / "w.safetensors", **info1)
    loaded = load_shapes_features(path)
    x = _world_images(5, 3)
    assert torch.allclose(loaded(x), m1(x))


@pytest.mark.slow
def test_inception_extractor_loads_local_weights_file(tmp_path, monkeypatch):
    # The real FID weights cannot be downloaded here: save a random state dict of the same network and
    # check the local-file path end to end (2048 features, FID of identical sets = 0).
    fe = pytest.importorskip("torch_fidelity.feature_extractor_inceptionv3")
    with monkeypatch.context() as m:  # build the network without loading any weights
        m.setattr(torch, "load", lambda *a, **k: {})
        m.setattr(nn.Module, "load_state_dict", lambda self, *a, **k: None)
        net = fe.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path="unused")
    path = tmp_path / "inception.pth"
    torch.save(net.state_dict(), path)
    extractor = load_feature_extractor("inception", path)
    images = torch.randint(0, 256, (3, 3, 64, 64), dtype=torch.uint8)
    feats = extract_features(images, extractor)
    assert feats.shape == (3, 2048) and np.isfinite(feats).all()
    assert compute_fid(images, images, "inception", weights=path).fid == pytest.approx(0.0, abs=1e-3)
