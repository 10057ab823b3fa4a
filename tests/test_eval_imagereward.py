"""ImageReward through the image-reward package on a tiny random-weight model, offline: the
transformers 5 shims, the forward it computes, local files, bad input and the install hint."""

from __future__ import annotations

import importlib.util
import json
import sys
import warnings

import pytest
import torch
from PIL import Image

if importlib.util.find_spec("ImageReward") is None:  # importing it needs the shims: only look it up
    pytest.skip("image-reward is installed by scripts/setup_extras.sh", allow_module_level=True)

from mmspec.evaluation import imagereward as irmod  # noqa: E402
from mmspec.evaluation.imagereward import (  # noqa: E402
    ImageRewardScorer,
    build_imagereward,
    compute_imagereward,
    import_imagereward,
    load_bert_tokenizer,
)

VISION = {"embed_dim": 32, "depth": 1, "num_heads": 2, "patch_size": 32}
WORDS = ["a", "red", "blue", "green", "circle", "square", "photo", "of", "and", "two"]
MED_CONFIG = {
    "architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1, "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 64,
    "layer_norm_eps": 1e-12, "max_position_embeddings": 40, "model_type": "bert", "num_attention_heads": 2,
    "num_hidden_layers": 1, "pad_token_id": 0, "type_vocab_size": 2, "vocab_size": 32, "encoder_width": 32,
    "add_cross_attention": True,
}
PROMPTS = ["a red circle", "a blue square", "two green circle", "a photo of a square"]
COLORS = [(230, 30, 30), (40, 80, 240), (40, 190, 60), (235, 235, 235)]


def test_import_keeps_warning_filters_and_installs_shims():
    import_imagereward()
    # The package calls warnings.filterwarnings("ignore") at import; that must not leak out.
    assert ("ignore", None, Warning, None, 0) not in warnings.filters
    with pytest.warns(UserWarning, match="still visible"):
        warnings.warn("still visible", UserWarning, stacklevel=1)
    import transformers.modeling_utils as mu

    for name in ("apply_chunking_to_forward", "find_pruneable_heads_and_indices", "prune_linear_layer"):
        assert hasattr(mu, name)
    heads, index = mu.find_pruneable_heads_and_indices({1}, n_heads=3, head_size=2, already_pruned_heads=set())
    assert heads == {1} and index.tolist() == [0, 1, 4, 5]


def test_missing_package_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "ImageReward.ImageReward", None)
    with pytest.raises(ImportError, match=r"pip install .*image-reward==1.5.*openai-clip"):
        import_imagereward()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("imagereward")
    (root / "tok").mkdir()
    (root / "tok" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
    (root / "med_config.json").write_text(json.dumps(MED_CONFIG))
    torch.manual_seed(0)
    model = build_imagereward(root / "med_config.json", root / "tok", vision=VISION)
    # ImageReward initialises its 5-layer head with std 1/769, which makes a random model's rewards
    # equal to 6 digits; wider weights make the test able to see the inputs' effect.
    for layer in model.mlp.layers:
        if isinstance(layer, torch.nn.Linear):
            torch.nn.init.normal_(layer.weight, std=0.5)
    torch.save(model.state_dict(), root / "ImageReward.pt")
    return root


@pytest.fixture(scope="module")
def scorer(files):
    return ImageRewardScorer(files / "ImageReward.pt", files / "med_config.json", files / "tok", vision=VISION)


def _images():
    return [Image.new("RGB", (48, 48), c) for c in COLORS]


def test_scores_follow_the_imagereward_forward(scorer):
    images = _images()
    scores = scorer.score(images, PROMPTS)
    assert len(scores) == 4 and all(isinstance(s, float) for s in scores)
    model = scorer.model
    with torch.no_grad():
        for image, prompt, score in zip(images, PROMPTS, scores):
            tokens = model.blip.tokenizer(prompt, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
            image_embeds = model.blip.visual_encoder(model.preprocess(image).unsqueeze(0))  # [1, 1 + patches, 32]
            text = model.blip.text_encoder(tokens.input_ids, attention_mask=tokens.attention_mask,
                                           encoder_hidden_states=image_embeds,
                                           encoder_attention_mask=torch.ones(image_embeds.shape[:-1], dtype=torch.long),
                                           return_dict=True)
            raw = model.mlp(text.last_hidden_state[:, 0, :]).item()
            assert score == pytest.approx((raw - model.mean) / model.std, rel=1e-5, abs=1e-6)
    # The reward depends on the prompt and on the image.
    assert len({round(s, 6) for s in scores}) == 4
    assert scorer.score([images[0]], [PROMPTS[1]])[0] != pytest.approx(scores[0])
    assert scorer.score([images[1]], [PROMPTS[0]])[0] != pytest.approx(scores[0])


def test_tokenizer_has_blip_special_tokens(files):
    tok = load_bert_tokenizer(files / "tok")
    assert tok.convert_tokens_to_ids("[DEC]") == tok.bos_token_id
    assert tok.enc_token_id == tok.convert_tokens_to_ids("[ENC]") != tok.unk_token_id
    assert tok("a red circle")["input_ids"][0] == tok.cls_token_id


def test_weights_are_loaded_from_the_file(files, scorer):
    torch.manual_seed(1)
    again = ImageRewardScorer(files / "ImageReward.pt", files / "med_config.json", files / "tok", vision=VISION)
    assert again.score(_images(), PROMPTS) == pytest.approx(scorer.score(_images(), PROMPTS), rel=1e-6)
    assert again.missing_keys == []


def test_folder_and_cli(tmp_path, files, scorer, capsys):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i, image in enumerate(_images()):
        image.save(folder / f"{i}.png")
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS))
    expected = sum(scorer.score(_images(), PROMPTS)) / 4
    result = compute_imagereward(folder, tmp_path / "prompts.txt", scorer=scorer)
    assert result.image_reward == pytest.approx(expected, rel=1e-5) and result.num_pairs == 4
    out = tmp_path / "ir.json"
    assert irmod.main([str(folder), "--prompts", str(tmp_path / "prompts.txt"), "--weights", str(files / "ImageReward.pt"),
                       "--med-config", str(files / "med_config.json"), "--tokenizer", str(files / "tok"),
                       "--vision", json.dumps(VISION), "--output", str(out), "--no-progress"]) == 0
    assert json.loads(out.read_text())["image_reward"] == pytest.approx(expected, rel=1e-5)
    assert "ImageReward:" in capsys.readouterr().out


def test_bad_input(tmp_path, files):
    (tmp_path / "empty_tok").mkdir()
    (tmp_path / "empty_tok" / "vocab.txt").write_text("")
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_bert_tokenizer(tmp_path / "no_tok")
    with pytest.raises(ValueError, match="empty or incomplete"):
        load_bert_tokenizer(tmp_path / "empty_tok")
    with pytest.raises(FileNotFoundError, match="weights"):
        ImageRewardScorer(tmp_path / "missing.pt", files / "med_config.json", files / "tok", vision=VISION)
    wide = dict(MED_CONFIG, hidden_size=64)
    (tmp_path / "med64.json").write_text(json.dumps(wide))
    with pytest.raises(ValueError, match="hidden_size must be 768"):
        build_imagereward(tmp_path / "med64.json", files / "tok", vision=VISION)
    small_vocab = dict(MED_CONFIG, vocab_size=8)
    (tmp_path / "med_small.json").write_text(json.dumps(small_vocab))
    with pytest.raises(ValueError, match="vocab_size"):
        build_imagereward(tmp_path / "med_small.json", files / "tok", vision=VISION)
    torch.save({"unrelated.weight": torch.zeros(3)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="does not match the ImageReward architecture"):
        ImageRewardScorer(tmp_path / "other.pt", files / "med_config.json", files / "tok", vision=VISION)
    with pytest.raises(ValueError, match="vision must be"):
        build_imagereward(files / "med_config.json", files / "tok", vision="huge")
