"""VLMPipeline (pipelines/vlm.py) on a tiny random LLaVA with a word-level processor, saved and reloaded
offline. Every method is lossless: greedy text equals "none" (fp32, batch with left padding, untrained
heads), sampled first tokens follow the same distribution; streaming reproduces the final text; bad
input gets clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from stats_utils import two_sample_chi2_pvalue

from mmspec.drafters import TreeConfig
from mmspec.models.eagle import EagleHead
from mmspec.models.vlm_drafters import EagleVLMHead, FlashHead, SpecVLMHead, ViSpecHead
from mmspec.pipelines.vlm import VLMPipeline, VLMStreamChunk

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WORDS = [f"w{i}" for i in range(40)]
SPECIALS = ["<pad>", "<s>", "</s>", "<image>", "<unk>"]
VOCAB = len(SPECIALS) + len(WORDS)
IMAGE_ID = 3


def _processor():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")
    tokenizer.add_tokens(["<image>"], special_tokens=True)  # split out of "<image><image>text"
    image_processor = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=4,
                          vision_feature_select_strategy="default", image_token="<image>",
                          num_additional_image_tokens=1)


def _llava(layers: int, hidden: int, seed: int):
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    clip = dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, image_size=16, patch_size=4, projection_dim=16)
    text = dict(model_type="llama", vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = LlavaConfig(vision_config=clip, text_config=text, image_token_index=IMAGE_ID, image_seq_length=16,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # sharper logits: drafts and targets with structure, fewer near-ties
        model.lm_head.weight.mul_(6.0)
        model.lm_head.weight[2] -= 0.5  # rare EOS keeps rows long
    return model


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    target, draft = _llava(2, 32, 0), _llava(1, 32, 1)
    torch.manual_seed(2)
    heads = {"eagle_head": EagleVLMHead(32, VOCAB), "flash_head": FlashHead(32, VOCAB, num_latents=4, num_future=3),
             "vispec_head": ViSpecHead(32, VOCAB), "specvlm_head": SpecVLMHead(32, VOCAB)}
    for head in heads.values():  # untrained but not degenerate: correctness never depends on acceptance
        for p in head.parameters():
            torch.nn.init.normal_(p, std=0.2)
    folder = tmp_path_factory.mktemp("vlm_pipe")
    VLMPipeline(target, _processor(), draft_model=draft, **heads).save_pretrained(folder)
    return VLMPipeline.from_pretrained(folder)


def _images(n: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)) for _ in range(n)]


PROMPTS = ["w1 w2 w3", "w4"]  # different lengths: the batch is left-padded


def test_reload_keeps_components(pipe):
    assert isinstance(pipe.eagle_head, EagleVLMHead) and isinstance(pipe.flash_head, FlashHead)
    assert isinstance(pipe.vispec_head, ViSpecHead) and isinstance(pipe.specvlm_head, SpecVLMHead)
    assert pipe.draft_model is not None
    assert pipe.tokenizer.padding_side == "left"
    assert pipe.format_prompt("w1", 2) == "<image><image>w1"


TREE = TreeConfig(depth=3, top_k=2, total_tokens=6)
VISUAL_TOKENS = {"eagle": [16, 16], "flash": [4, 4], "vispec": [1, 1], "draft_vlm": [16, 16]}


@pytest.mark.parametrize("method,tree", [("eagle", None), ("eagle", TREE), ("flash", None), ("vispec", None),
                                         ("vispec", TREE), ("specvlm", None), ("draft_vlm", None)])
def test_greedy_equals_target_only(pipe, method, tree):
    images = _images(2)
    base = pipe(images, PROMPTS, "none", max_new_tokens=24)
    spec = pipe(images, PROMPTS, pipe.method_config(method).replace(num_draft_tokens=4, tree=tree), max_new_tokens=24)
    assert spec.text == base.text
    for a, b in zip(spec.tokens, base.tokens):
        assert torch.equal(a, b)
    assert spec.stats.target_calls < base.stats.target_calls or spec.stats.mean_accepted_length >= 1.0
    if method in VISUAL_TOKENS:
        assert spec.draft_visual_tokens == VISUAL_TOKENS[method]
    else:  # SpecVLM: the gate's primitive decides (text-only 0 ... full span 16)
        assert all(0 <= n <= 16 for n in spec.draft_visual_tokens)
    assert base.draft_visual_tokens is None


@pytest.mark.parametrize("method", ["eagle", "flash", "vispec", "specvlm", "draft_vlm"])
def test_dynamic_chains_keep_the_output_with_fewer_draft_forwards(pipe, method):
    """draft_confidence_threshold stops chains early (fewer draft calls) and greedy text stays exact."""
    images = _images(2, seed=7)
    base = pipe(images, PROMPTS, "none", max_new_tokens=24)
    config = pipe.method_config(method).replace(num_draft_tokens=6)
    fixed = pipe(images, PROMPTS, config, max_new_tokens=24)
    dynamic = pipe(images, PROMPTS, config.replace(draft_confidence_threshold=0.95), max_new_tokens=24)
    assert dynamic.text == base.text == fixed.text
    for a, b in zip(dynamic.tokens, base.tokens):
        assert torch.equal(a, b)
    assert dynamic.stats.draft_calls < fixed.stats.draft_calls


def test_none_matches_transformers_generate(pipe):
    image = _images(1, seed=3)[0]
    ours = pipe(image, "w5 w6", "none", max_new_tokens=12)
    inputs = pipe.encode(image, "w5 w6").inputs
    reference = pipe.target.generate(**inputs, max_new_tokens=12, do_sample=False)
    generated = reference[0, inputs["input_ids"].shape[1]:]
    assert torch.equal(ours.tokens[0], generated[: ours.tokens[0].shape[0]])


def test_video_frames_enter_as_images(pipe):
    frames = _images(3, seed=4)
    out = pipe(videos=[frames], prompt="w7", method="eagle", max_new_tokens=10)
    base = pipe(frames, "w7", "none", max_new_tokens=10)  # the same frames as a multi-image prompt
    assert out.text == base.text
    assert out.draft_visual_tokens == [48]


def test_sampled_first_tokens_follow_the_target(pipe):
    """Positions 1 and 2 of 600 sampled rows: eagle vs none, chi-square two-sample p > 1e-3."""
    image = _images(1, seed=5)[0]
    rows = 600
    draws = {}
    eagle = pipe.method_config("eagle", do_sample=True).replace(num_draft_tokens=3)
    for name, method in (("none", "none"), ("eagle", eagle)):
        out = pipe([image] * rows, ["w8"] * rows, method, do_sample=True, max_new_tokens=3,
                   generator=torch.Generator().manual_seed(11 if name == "none" else 12))
        draws[name] = torch.stack([t[:3] if t.shape[0] >= 3 else torch.nn.functional.pad(t, (0, 3 - t.shape[0]), value=-1)
                                   for t in out.tokens])
    for position in (1, 2):
        a, b = draws["none"][:, position], draws["eagle"][:, position]
        assert two_sample_chi2_pvalue(a[a >= 0].numpy(), b[b >= 0].numpy()) > 1e-3


def test_stream_yields_the_final_text(pipe):
    images = _images(2, seed=6)
    chunks, final = {0: [], 1: []}, None
    for item in pipe.stream(images, PROMPTS, "eagle", max_new_tokens=16):
        if isinstance(item, VLMStreamChunk):
            chunks[item.row].append(item)
        else:
            final = item
    assert final is not None
    for row in (0, 1):
        assert "".join(c.text for c in chunks[row]).strip() == final.text[row].strip()
        assert sum(len(c.tokens) for c in chunks[row]) == final.tokens[row].shape[0]
        assert sum(sum(c.drafted) for c in chunks[row]) == int(final.drafted[row].sum())


def test_transformers_streamer(pipe):
    """As with transformers' generate: the streamer sees the prompt first (skip_prompt drops it), then the answer."""
    from transformers import TextIteratorStreamer

    streamer = TextIteratorStreamer(pipe.tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=120)
    out = pipe(_images(1)[0], "w9", "eagle", max_new_tokens=10, streamer=streamer)
    assert "".join(streamer).strip() == out.text[0].strip()
    with_prompt = TextIteratorStreamer(pipe.tokenizer, skip_special_tokens=True, timeout=120)
    pipe(_images(1)[0], "w9", "eagle", max_new_tokens=10, streamer=with_prompt)
    streamed = "".join(with_prompt)  # a streamer's queue is read once
    assert streamed.strip().endswith(out.text[0].strip()) and "w9" in streamed


def test_bad_input(pipe):
    image = _images(1)[0]
    with pytest.raises(ValueError, match=r"method='medusa' is not a method of VLMPipeline.*'eagle'"):
        pipe(image, "w1", "medusa")
    with pytest.raises(ValueError, match="at least one image"):
        pipe(None, "w1", "none")
    with pytest.raises(ValueError, match="2 image"):
        pipe(image, "<image><image> w1", "none")
    with pytest.raises(ValueError, match="entries for 2 prompt"):
        pipe([image, image, image], ["w1", "w2"], "none")
    with pytest.raises(ValueError, match="non-empty"):
        pipe(image, [], "none")
    with pytest.raises(ValueError, match=r"prompt 1 .* outside its vocabulary: \['zebra'\]"):  # not read as <unk>
        pipe([image, image], ["w1", "w2 zebra."], "none")
    pixels = np.asarray(image, dtype=np.float32)
    with pytest.raises(ValueError, match=r"in \[0, 1\].*uint8"):  # 0-255 floats would clip to a white image
        pipe(pixels, "w1", "none")
    pixels[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        pipe(pixels / 255, "w1", "none")
    with pytest.raises(ValueError, match="top_k"):
        pipe(image, "w1", "none", do_sample=True, top_k=VOCAB + 1)
    unlimited, disabled = (pipe(image, "w1", "none", do_sample=True, top_k=k, max_new_tokens=6,
                                generator=torch.Generator().manual_seed(3)).tokens for k in (None, 0))
    assert all(torch.equal(a, b) for a, b in zip(unlimited, disabled))  # top_k=0 disables it, as in the core
    with pytest.raises(ValueError, match="callback_on_step_end must be callable"):
        pipe(image, "w1", "none", callback_on_step_end="print")
    with pytest.raises(ValueError, match="FlashConfig.tree must be None: this method drafts chains only"):
        pipe.method_config("flash").replace(tree=TREE)
    with pytest.raises(ValueError, match="VLMEagleConfig.draft_confidence_threshold must be a number"):
        pipe.method_config("eagle").replace(draft_confidence_threshold=1.5)
    with pytest.raises(ValueError, match="dynamic already"):
        pipe.method_config("vispec").replace(tree=TREE, draft_confidence_threshold=0.5)
    bare = VLMPipeline(pipe.target, pipe.processor)
    with pytest.raises(ValueError, match="needs a flash_head"):
        bare(image, "w1", "flash")


def test_mismatched_components_are_rejected(pipe):
    wide = EagleHead(hidden_size=48, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="hidden size mismatch"):
        VLMPipeline(pipe.target, pipe.processor, eagle_head=wide)
    with pytest.raises(ValueError, match="another target"):
        VLMPipeline(pipe.target, pipe.processor, flash_head=FlashHead(48, VOCAB))
    other_vocab = EagleHead(hidden_size=32, vocab_size=VOCAB + 3)
    with pytest.raises(ValueError, match="vocab mismatch"):
        VLMPipeline(pipe.target, pipe.processor, eagle_head=other_vocab)
    with pytest.raises(ValueError, match="model must be one of"):
        VLMPipeline(torch.nn.Linear(2, 2), pipe.processor)


def test_diffusers_style_callback_return_dict_and_a_streamer_that_skips_the_prompt():
    """callback_on_step_end(pipe, step, timestep, kwargs) -> dict with the requested tensors; return_dict=False
    gives a tuple; a TextStreamer with skip_prompt=True prints the whole answer (the prompt is sent first)."""
    from transformers import TextStreamer

    from mmspec.pipelines import VLMPipeline
    from mmspec.world import render_scene, sample_scene

    pipe = VLMPipeline.from_pretrained("mmspec/shapes-vlm")
    pipe.set_progress_bar_config(disable=True)
    image = render_scene(sample_scene(0), image_size=64)
    seen = []
    out = pipe(image, "describe the image in detail.", "flash", max_new_tokens=24,
               callback_on_step_end=lambda p, step, t, kw: seen.append((step, t, sorted(kw))) or kw,
               callback_on_step_end_tensor_inputs=["drafted"])
    assert [s for s, _, _ in seen] == list(range(len(seen))) and all(keys == ["drafted"] for _, _, keys in seen)
    assert seen[-1][1] == len(out.tokens[0])
    text, tokens, drafted, stats, visual = pipe(image, "describe the image in detail.", "flash", max_new_tokens=24,
                                                return_dict=False)
    assert text == out.text and torch.equal(tokens[0], out.tokens[0])
    printed = []

    class Collect(TextStreamer):
        def on_finalized_text(self, chunk: str, stream_end: bool = False) -> None:
            printed.append(chunk)

    pipe(image, "describe the image in detail.", "flash", max_new_tokens=24,
         streamer=Collect(pipe.tokenizer, skip_prompt=True, skip_special_tokens=True))
    assert "".join(printed).strip() == out.text[0].strip()
