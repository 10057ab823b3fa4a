"""Image tokenizers: VQ (k-means codebook) and continuous (patch autoencoder), the recipe, the zoo."""

import json

import numpy as np
import pytest
import torch

from mmspec.models.recipes import train_tokenizers
from mmspec.models.recipes.autoencoder_training import train_autoencoder
from mmspec.models.tokenizers import (
    ContinuousTokenizer,
    VQTokenizer,
    kmeans,
    load_zoo_tokenizer,
    zoo_tokenizer_path,
)
from mmspec.world import parse_image, render_scene, rng_for, sample_scene, scene_matches, to_tensor


def _images(n, seed=0, difficulty=1.0):
    return to_tensor(np.stack([render_scene(sample_scene(rng_for("test", seed, i)), 32, difficulty) for i in range(n)]))


@pytest.fixture(scope="module")
def tiny_vq():
    vq = VQTokenizer(codebook_size=64)
    patches = vq.patchify(_images(40)).reshape(-1, vq.patch_dim)
    return vq.fit_codebook(patches, iters=3, seed=0)


# ----------------------------------------------------------------------------------------------------
# VQ
# ----------------------------------------------------------------------------------------------------


def test_vq_encode_decode_shapes_and_fixed_points(tiny_vq):
    x = _images(3)
    tokens = tiny_vq.encode(x)
    assert tokens.shape == (3, 8, 8) and tokens.dtype == torch.long
    assert 0 <= tokens.min() and tokens.max() < 64
    recon = tiny_vq.decode(tokens)
    assert recon.shape == x.shape and recon.min() >= 0 and recon.max() <= 1
    # a decoded image is made of codebook patches, so it re-encodes to the same tokens
    assert torch.equal(tiny_vq.encode(recon), tokens)
    assert torch.equal(tiny_vq(x), recon)
    assert tiny_vq.embed(tokens).shape == (3, 8, 8, 48)
    # other multiples of the patch size work too
    assert tiny_vq.encode(torch.zeros(1, 3, 16, 24)).shape == (1, 4, 6)


def test_vq_nearest_entry_is_chosen(tiny_vq):
    x = _images(2)
    tokens = tiny_vq.encode(x)
    patches = tiny_vq.patchify(x).reshape(-1, 48)
    dist = torch.cdist(patches, tiny_vq.codebook)
    chosen = dist.gather(1, tokens.reshape(-1, 1)).squeeze(1)
    assert torch.allclose(chosen, dist.min(1).values, atol=1e-5)


def test_codebook_neighbors(tiny_vq):
    nbrs = tiny_vq.codebook_neighbors(5)
    assert nbrs.shape == (64, 5) and nbrs.dtype == torch.long
    assert not (nbrs == torch.arange(64)[:, None]).any()
    d = torch.cdist(tiny_vq.codebook.double(), tiny_vq.codebook.double())
    d.fill_diagonal_(float("inf"))
    got = d.gather(1, nbrs)
    assert (got[:, 1:] >= got[:, :-1]).all()  # ordered by distance
    assert torch.allclose(got[:, 0], d.min(1).values)
    assert torch.allclose(got[:, -1], d.sort(1).values[:, 4])
    for k in (0, 64, 2.5):
        with pytest.raises(ValueError, match="k must"):
            tiny_vq.codebook_neighbors(k)


def test_vq_bad_inputs(tiny_vq):
    with pytest.raises(ValueError, match="shape"):
        tiny_vq.encode(torch.zeros(3, 32, 32))
    with pytest.raises(ValueError, match="shape"):
        tiny_vq.encode(torch.zeros(1, 4, 32, 32))
    with pytest.raises(ValueError, match="multiples"):
        tiny_vq.encode(torch.zeros(1, 3, 30, 32))
    with pytest.raises(ValueError, match="float"):
        tiny_vq.encode(torch.zeros(1, 3, 32, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        tiny_vq.encode(torch.full((1, 3, 32, 32), 255.0))
    with pytest.raises(ValueError, match="outside"):
        tiny_vq.decode(torch.full((1, 8, 8), 64))
    with pytest.raises(ValueError, match="outside"):
        tiny_vq.decode(torch.full((1, 8, 8), -1))
    with pytest.raises(ValueError, match="integer"):
        tiny_vq.decode(torch.zeros(1, 8, 8))
    with pytest.raises(ValueError, match="shape"):
        tiny_vq.decode(torch.zeros(8, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="codebook_size"):
        VQTokenizer(codebook_size=0)
    with pytest.raises(ValueError, match="patches"):
        tiny_vq.fit_codebook(torch.zeros(10, 12))


def test_vq_save_load_roundtrip(tiny_vq, tmp_path):
    tiny_vq.save_pretrained(tmp_path / "vq")
    loaded = VQTokenizer.from_pretrained(tmp_path / "vq")
    assert loaded.config.codebook_size == 64
    assert torch.equal(loaded.codebook, tiny_vq.codebook)
    x = _images(2, seed=1)
    assert torch.equal(loaded.encode(x), tiny_vq.encode(x))


def test_from_pretrained_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer folder"):
        VQTokenizer.from_pretrained(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        ContinuousTokenizer.from_pretrained(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="kind"):
        zoo_tokenizer_path("vqgan")


def test_kmeans_is_deterministic_and_reduces_error():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(200, 4, generator=g) * 0.1 + c for c in (0.0, 3.0, -3.0)])
    a, b = kmeans(x, 3, iters=5, seed=1), kmeans(x, 3, iters=5, seed=1)
    assert torch.equal(a, b)
    assert sorted(a.mean(1).round().tolist()) == [-3.0, 0.0, 3.0]  # finds the three clusters
    with pytest.raises(ValueError, match="k must"):
        kmeans(x, 10_000)


# ----------------------------------------------------------------------------------------------------
# continuous
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_ae():
    ae = ContinuousTokenizer(latent_dim=8, hidden_dim=32)
    patches = ae.patchify(_images(30)).reshape(-1, ae.patch_dim)
    losses = train_autoencoder(ae, patches, steps=60, batch_size=256, seed=0)
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])  # it learns
    return ae


def test_continuous_shapes_and_standardised_latents(tiny_ae):
    x = _images(20)
    z = tiny_ae.encode(x)
    assert z.shape == (20, 8, 8, 8) and z.dtype == torch.float32
    flat = z.reshape(-1, 8)
    assert flat.mean(0).abs().max() < 0.3 and (flat.std(0) - 1).abs().max() < 0.3
    recon = tiny_ae.decode(z)
    assert recon.shape == x.shape and recon.min() >= 0 and recon.max() <= 1
    assert ((recon - x) ** 2).mean() < ((x - x.mean()) ** 2).mean()


def test_continuous_save_load_and_bad_inputs(tiny_ae, tmp_path):
    tiny_ae.save_pretrained(tmp_path / "ae")
    loaded = ContinuousTokenizer.from_pretrained(tmp_path / "ae")
    x = _images(2, seed=2)
    assert torch.allclose(loaded.encode(x), tiny_ae.encode(x))
    assert torch.equal(loaded.latent_std, tiny_ae.latent_std)
    with pytest.raises(ValueError, match="shape"):
        tiny_ae.decode(torch.zeros(1, 8, 8, 5))
    with pytest.raises(ValueError, match="NaN"):
        tiny_ae.decode(torch.full((1, 8, 8, 8), float("nan")))
    with pytest.raises(ValueError, match="float"):
        tiny_ae.decode(torch.zeros(1, 8, 8, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="shape"):
        tiny_ae.encode(torch.zeros(1, 1, 32, 32))


def test_autoencoder_training_is_deterministic():
    patches = ContinuousTokenizer().patchify(_images(5)).reshape(-1, 48)
    a, b = ContinuousTokenizer(latent_dim=4, hidden_dim=16), ContinuousTokenizer(latent_dim=4, hidden_dim=16)
    la = train_autoencoder(a, patches, steps=5, batch_size=64, seed=3)
    lb = train_autoencoder(b, patches, steps=5, batch_size=64, seed=3)
    assert la == lb
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


# ----------------------------------------------------------------------------------------------------
# recipe and zoo
# ----------------------------------------------------------------------------------------------------


def test_recipe_runs_and_is_deterministic(tmp_path):
    args = ["--train-images", "60", "--codebook-size", "32", "--kmeans-iters", "2", "--ae-steps", "10",
            "--heldout", "5", "--prompts-per-category", "2", "--threads", "1"]
    report = train_tokenizers.main(["--out", str(tmp_path / "a"), *args])
    train_tokenizers.main(["--out", str(tmp_path / "b"), *args])
    for kind in ("vq", "continuous"):
        for name in ("config.json", "diffusion_pytorch_model.safetensors"):
            assert (tmp_path / "a" / kind / name).is_file()
        one = (tmp_path / "a" / kind / "diffusion_pytorch_model.safetensors").read_bytes()
        two = (tmp_path / "b" / kind / "diffusion_pytorch_model.safetensors").read_bytes()
        assert one == two
        entry = report[kind]["heldout"]["difficulty_1"]
        assert 0.0 <= entry["scene_accuracy"] <= 1.0 and "geneval" in entry
    saved = json.loads((tmp_path / "a" / "report.json").read_text())
    assert saved["vq"]["config"]["codebook_size"] == 32


def _zoo_accuracy(tokenizer, num, difficulty):
    scenes = [sample_scene(rng_for("tokenizer-heldout", 0, 50_000 + i)) for i in range(num)]
    x = to_tensor(np.stack([render_scene(s, 32, difficulty) for s in scenes]))
    recon = tokenizer.decode(tokenizer.encode(x))
    return np.mean([scene_matches(parse_image(r), s) for r, s in zip(recon, scenes)])


@pytest.mark.parametrize("kind", ["vq", "continuous"])
def test_zoo_tokenizers_reconstruct_held_out_scenes(kind):
    tok = load_zoo_tokenizer(kind)
    path = zoo_tokenizer_path(kind)
    assert (path / "diffusion_pytorch_model.safetensors").stat().st_size < 5 * 2**20
    assert tok.grid_size() ** 2 == 64
    report = json.loads((path.parent / "report.json").read_text())
    assert report[kind]["heldout"]["difficulty_1"]["scene_accuracy"] >= 0.99
    assert _zoo_accuracy(tok, 150, 1.0) >= 0.97


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["vq", "continuous"])
@pytest.mark.parametrize("difficulty", [0.0, 1.0, 2.0])
def test_zoo_tokenizers_reconstruct_1000_scenes(kind, difficulty):
    assert _zoo_accuracy(load_zoo_tokenizer(kind), 1000, difficulty) >= 0.99


def test_zoo_vq_has_neighbourhoods():
    vq = load_zoo_tokenizer("vq")
    assert vq.vocab_size == 2048
    nbrs = vq.codebook_neighbors(8)
    assert nbrs.shape == (2048, 8)
