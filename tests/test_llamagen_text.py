"""LlamaGen's text side: T5 caption features in LlamaGen's layout, a caption-feature t2i model in
ARImagePipeline (official file layouts, save/load, losslessness of EAGLE) and LlamaGen's VQ pixel range.

Everything is tiny, random and offline: a 2-layer T5 encoder with a word-level tokenizer saved next to
it, a LlamaGen t2i GPT that reads 16-wide caption features (float64) and a 2x down-sampling LlamaGen VQ.
"""

from __future__ import annotations

import pytest
import torch
from test_ar_image_pipeline import V as COPY_HEAD_VOCAB
from test_ar_image_pipeline import copy_head
from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

from mmspec.methods.jacobi import SJDConfig
from mmspec.models.llamagen import LlamaGenTransformer
from mmspec.models.llamagen_text import caption_features, load_llamagen_components, preprocess_caption
from mmspec.models.llamagen_vq import LlamaGenVQModel
from mmspec.pipelines import ARImagePipeline

V, GRID, CAPTION_LEN, WIDTH = COPY_HEAD_VOCAB, 4, 8, 16  # the copy head (32 features) predicts V tokens
WORDS = ["a", "and", "blue", "circle", "green", "red", "square", "triangle", "big", "small", "left", "of"]
PROMPTS = ["a red circle", "  A Big Blue Square and a small green triangle left of a circle  ", "circle"]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer that behaves like T5's for these tests: pad 0, eos 1 appended, unk 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def tiny_t5() -> T5EncoderModel:
    torch.manual_seed(3)
    config = T5Config(vocab_size=len(WORDS) + 3, d_model=WIDTH, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                      feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return T5EncoderModel(config).double().eval()


def tiny_gpt(seed: int = 0) -> LlamaGenTransformer:
    torch.manual_seed(seed)
    model = LlamaGenTransformer(dim=32, n_layer=2, n_head=4, multiple_of=16, vocab_size=V, block_size=GRID * GRID,
                                model_type="t2i", cls_token_num=CAPTION_LEN, caption_dim=WIDTH).double().eval()
    with torch.no_grad():  # sharper logits and attention, so greedy choices are not ties and conditions matter
        model.output.weight.mul_(30.0)
        for layer in model.layers:
            layer.attention.wqkv.weight.mul_(10.0)
    return model


def tiny_vq() -> LlamaGenVQModel:
    torch.manual_seed(4)
    return LlamaGenVQModel(codebook_size=V, codebook_embed_dim=8, encoder_ch_mult=[1, 2], decoder_ch_mult=[1, 2],
                           z_channels=32, ch=32, num_res_blocks=1).double().eval()


@pytest.fixture(scope="module")
def pipe() -> ARImagePipeline:
    pipe = ARImagePipeline(tiny_gpt(), tiny_vq(), copy_head(), text_encoder=tiny_t5(), tokenizer=tiny_tokenizer())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_caption_features_follow_llamagens_layout(pipe):
    """Valid tokens last, padding zero and masked, features of each valid token those of the encoder (as
    LlamaGen's sampler rotates them); long captions keep their first tokens."""
    long_prompt = " ".join(["red"] * 20)
    texts = [*PROMPTS, long_prompt]
    condition, mask = pipe.encode_prompt(texts)
    features = condition["condition_embeds"]
    assert features.shape == (4, CAPTION_LEN, WIDTH) and mask.shape == (4, CAPTION_LEN)
    raw, raw_mask = caption_features(texts, pipe.tokenizer, pipe.text_encoder, CAPTION_LEN)
    for row in range(4):
        valid = int(raw_mask[row].sum())
        assert raw_mask[row, :valid].all() and not raw_mask[row, valid:].any()  # right-padded by the tokenizer
        expected = torch.cat([raw[row, valid:] * 0, raw[row, :valid]])  # LlamaGen: cat([emb[valid:], emb[:valid]])
        assert torch.equal(features[row], expected)
        assert mask[row].tolist() == [0] * (CAPTION_LEN - valid) + [1] * valid
    assert int(mask[3].sum()) == CAPTION_LEN  # truncated to the first 7 words + the end-of-sequence token
    ids = pipe.tokenizer([preprocess_caption(PROMPTS[1])])["input_ids"][0]
    assert pipe.tokenizer.unk_token_id not in ids  # upper case and outer spaces removed before tokenizing


def test_prompts_condition_the_transformer_through_the_text_encoder(pipe):
    """The pipeline's first image token is the transformer's greedy choice on the encoded caption, and
    different captions give different images."""
    out = pipe(PROMPTS, method="none", do_sample=False, guidance_scale=1.0, output_type="tokens")
    condition, mask = pipe.encode_prompt(PROMPTS)
    logits = pipe.transformer(attention_mask=mask, **condition).logits[:, -1]
    assert torch.equal(out.tokens.reshape(3, -1)[:, 0], logits.argmax(-1))
    assert len({tuple(t.flatten().tolist()) for t in out.tokens}) == 3


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0], ids=["no-cfg", "cfg"])
@pytest.mark.parametrize("method", ["eagle", SJDConfig(window=5)], ids=["eagle", "sjd"])
def test_greedy_speculation_reproduces_target_only_tokens(pipe, method, guidance_scale):
    base = pipe(PROMPTS, method="none", do_sample=False, guidance_scale=guidance_scale, output_type="tokens")
    spec = pipe(PROMPTS, method=method, do_sample=False, guidance_scale=guidance_scale, output_type="tokens")
    assert torch.equal(spec.tokens, base.tokens)
    assert spec.drafted.any()  # some tokens came from accepted drafts: the comparison means something


def test_llamagen_vq_pixels_are_mapped_to_the_unit_range(pipe):
    out = pipe("a red circle", method="none", do_sample=False, output_type="pt")
    expected = ((pipe.vqvae.decode(out.tokens) + 1) / 2).float()
    assert out.images.shape == (1, 3, 2 * GRID, 2 * GRID)
    assert torch.allclose(out.images, expected) and out.images.min() >= 0 and out.images.max() <= 1
    assert pipe.vqvae.decode(out.tokens).min() < 0  # the VQ itself decodes to [-1, 1]: the mapping matters


def test_official_files_and_save_pretrained_round_trip(pipe, tmp_path):
    """GPT and VQ in the official checkpoint layouts plus a T5 folder load into the same pipeline
    (load_llamagen_components); save_pretrained / from_pretrained keep the text encoder and tokenizer."""
    torch.save({"model": pipe.transformer.state_dict()}, tmp_path / "t2i.pt")
    torch.save({"state_dict": pipe.vqvae.state_dict()}, tmp_path / "vq.pt")
    pipe.text_encoder.save_pretrained(tmp_path / "t5")
    pipe.tokenizer.save_pretrained(tmp_path / "t5")
    components = load_llamagen_components(tmp_path / "t2i.pt", tmp_path / "vq.pt", tmp_path / "t5",
                                          block_size=GRID * GRID, n_head=4, multiple_of=16)
    assert set(components) == {"transformer", "vqvae", "text_encoder", "tokenizer"}
    loaded = ARImagePipeline(**components, eagle_head=copy_head())
    loaded.set_progress_bar_config(disable=True)
    expected = pipe(PROMPTS, method="none", do_sample=False, output_type="tokens").tokens
    assert torch.equal(loaded(PROMPTS, method="eagle", do_sample=False, output_type="tokens").tokens, expected)

    pipe.save_pretrained(tmp_path / "saved")
    again = ARImagePipeline.from_pretrained(tmp_path / "saved")
    again.set_progress_bar_config(disable=True)
    assert type(again.text_encoder).__name__ == "T5EncoderModel" and again.tokenizer is not None
    assert torch.equal(again(PROMPTS, method="eagle", do_sample=False, output_type="tokens").tokens, expected)

    with pytest.raises(ValueError, match="is a text-to-image model: pass text_encoder"):
        load_llamagen_components(tmp_path / "t2i.pt", tmp_path / "vq.pt", block_size=GRID * GRID, n_head=4, multiple_of=16)


def test_bad_text_encoder_set_ups_raise_clear_errors(pipe):
    gpt, vq = pipe.transformer, pipe.vqvae
    with pytest.raises(ValueError, match="text_encoder and tokenizer come together"):
        ARImagePipeline(gpt, vq, text_encoder=pipe.text_encoder)
    narrow = T5EncoderModel(T5Config(vocab_size=len(WORDS) + 3, d_model=8, d_kv=4, d_ff=16, num_layers=1,
                                     num_heads=2, decoder_start_token_id=0))
    with pytest.raises(ValueError, match="width 8, the transformer reads caption features of width 16"):
        ARImagePipeline(gpt, vq, text_encoder=narrow, tokenizer=pipe.tokenizer)
    word_model = LlamaGenTransformer(dim=32, n_layer=1, n_head=4, multiple_of=16, vocab_size=V, block_size=16,
                                     model_type="t2i", cls_token_num=CAPTION_LEN, caption_dim=WIDTH, text_vocab_size=9)
    with pytest.raises(ValueError, match="text_vocab_size=None"):
        ARImagePipeline(word_model, vq, text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer)
    without = ARImagePipeline(gpt, vq)
    with pytest.raises(ValueError, match="build the pipeline with its text_encoder and tokenizer"):
        without("a red circle", output_type="tokens")
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        pipe(["a red circle", "   "], output_type="tokens")
