"""VLM targets (models/vlm_targets.py): tiny random LLaVA, Qwen2-VL and Qwen2.5-VL checkpoints saved and reloaded
offline, driven by the core loop. Greedy decoding in fp32: target-only == transformers' generate, and every
drafter (text-only draft model, untrained EAGLE head, the VLM drafting itself; chains and trees) reproduces it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_llama
from PIL import Image

from mmspec import ModelDrafter, TreeConfig, speculative_generate
from mmspec.models.eagle import EagleDrafter, EagleHead
from mmspec.models.vlm_targets import VLMPrefillOutput, VLMRunner, vlm_family
from mmspec.tree import tree_attention_mask, tree_position_offsets

VOCAB, PAD, WORDS = 64, 0, (3, 50)  # text tokens are drawn from WORDS
IMAGE, VIDEO, VISION_START, VISION_END = 60, 61, 58, 59
FAMILIES = ["llava", "llava_next", "qwen2_vl", "qwen2_5_vl"]
MAX_NEW = 16
PINPOINTS = [[16, 32], [32, 16], [32, 32]]  # LLaVA-NeXT anyres grids of the tiny 16-pixel CLIP tower


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- tiny checkpoints ---------------------------------------------------------------------------------------
def _text_config(**extra) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=PAD,
                bos_token_id=None, eos_token_id=None, **extra)


def _build(family: str):
    from transformers import (
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}  # head_dim 8
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START,
               vision_end_token_id=VISION_END, tie_word_embeddings=False)
    clip = dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, image_size=16, patch_size=4, projection_dim=16)
    if family == "llava":
        config = LlavaConfig(vision_config=clip, text_config=dict(model_type="llama", **_text_config()),
                             image_token_index=IMAGE, image_seq_length=16, tie_word_embeddings=False)
        return LlavaForConditionalGeneration, config
    if family == "llava_next":
        config = LlavaNextConfig(vision_config=clip, text_config=dict(model_type="llama", **_text_config()),
                                 image_token_index=IMAGE, image_grid_pinpoints=PINPOINTS, tie_word_embeddings=False)
        return LlavaNextForConditionalGeneration, config
    if family == "qwen2_vl":
        config = Qwen2VLConfig(
            text_config=_text_config(rope_parameters=mrope),
            vision_config=dict(depth=1, embed_dim=16, num_heads=2, mlp_ratio=2, hidden_size=32, patch_size=4,
                               spatial_merge_size=2, temporal_patch_size=2, in_channels=3), **ids)
        return Qwen2VLForConditionalGeneration, config
    config = Qwen2_5_VLConfig(
        text_config=_text_config(rope_parameters=mrope),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1],
                           in_channels=3), **ids)
    return Qwen2_5_VLForConditionalGeneration, config


@pytest.fixture(scope="module")
def vlms(tmp_path_factory):
    """family -> tiny fp32 model, built, saved with save_pretrained and reloaded from disk."""
    models = {}
    for seed, family in enumerate(FAMILIES):
        cls, config = _build(family)
        torch.manual_seed(seed)
        model = cls(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)  # random init gives near-uniform logits: sharpen them (fewer near-ties)
        folder = tmp_path_factory.mktemp(family)
        model.save_pretrained(folder)
        loaded = cls.from_pretrained(folder).eval()
        assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
        loaded.generation_config.eos_token_id = None
        models[family] = loaded
    return models


def _images(sizes, seed=0):
    rng = np.random.RandomState(seed)
    return [Image.fromarray(rng.randint(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def _prompts(model, seed: int = 0):
    """Batch 2, left padding, different lengths: row 0 has one image, row 1 two (of different sizes except for
    LLaVA-1.5, whose processor crops every image to the tower's size).

    Returns ``(input_ids, attention_mask, model_inputs, spans)``; spans are the expected image slot ranges.
    """
    family = vlm_family(model)
    g = torch.Generator().manual_seed(seed)

    def words(n):
        return torch.randint(*WORDS, (n,), generator=g).tolist()

    images = [_images([(16, 16)], seed), _images([(16, 24), (24, 16)], seed + 1)]
    flat = [im for row in images for im in row]
    open_, close = [], []
    if family == "llava":
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        processor = CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
        inputs = {"pixel_values": processor(flat, return_tensors="pt")["pixel_values"]}
        counts = [16, 16, 16]
    elif family == "llava_next":
        from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

        processor = LlavaNextImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                                               image_grid_pinpoints=PINPOINTS)
        inputs = dict(processor(flat, return_tensors="pt"))
        with torch.no_grad():  # anyres token counts (what LlavaNextProcessor computes when it expands <image>)
            features = model.model.get_image_features(
                inputs["pixel_values"], inputs["image_sizes"], vision_feature_layer=model.config.vision_feature_layer,
                vision_feature_select_strategy=model.config.vision_feature_select_strategy).pooler_output
        counts = [f.shape[0] for f in features]
    else:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        processor = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64,
                                             max_pixels=1024)
        inputs = dict(processor(flat, return_tensors="pt"))
        counts = (inputs["image_grid_thw"].prod(-1) // 4).tolist()
        open_, close = [VISION_START], [VISION_END]
    tokens = [counts[:1], counts[1:]]
    rows, spans = [], []
    layouts = [(3, 4), (2, 2, 3)]  # words before / between / after the images of each row
    for row_tokens, layout in zip(tokens, layouts):
        ids, row_spans = words(layout[0]), []
        for i, n in enumerate(row_tokens):
            ids += open_
            row_spans.append((len(ids), len(ids) + n))
            ids += [IMAGE] * n + close + words(layout[i + 1])
        rows.append(ids)
        spans.append(row_spans)
    width = max(map(len, rows))
    input_ids = torch.full((2, width), PAD)
    mask = torch.zeros(2, width, dtype=torch.long)
    for b, ids in enumerate(rows):
        input_ids[b, width - len(ids):] = torch.tensor(ids)
        mask[b, width - len(ids):] = 1
    spans = [[(s + width - len(ids), e + width - len(ids)) for s, e in row] for ids, row in zip(rows, spans)]
    if family.startswith("qwen"):  # what transformers 5 processors return; without it generate() skips M-RoPE
        inputs["mm_token_type_ids"] = (input_ids == IMAGE).int()
    return input_ids, mask, inputs, spans


def _generate(model, ids, mask, inputs, n=MAX_NEW):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=PAD, **inputs)
    return out[:, ids.shape[1]:]


def _full_logits(model, ids, mask, inputs, extra: torch.Tensor) -> torch.Tensor:
    """Logits of the last position of ``prompt + extra [B, L]`` computed without a cache: the model's own
    positions for the whole sequence (M-RoPE from ``get_rope_index``, LLaVA from the padding mask)."""
    seq = torch.cat([ids, extra], 1)
    full_mask = torch.cat([mask, torch.ones_like(extra)], 1)
    kwargs = dict(inputs)
    if vlm_family(model).startswith("llava"):
        kwargs["position_ids"] = (full_mask.cumsum(-1) - 1).clamp_min(0)
    else:
        kwargs["mm_token_type_ids"] = (seq == IMAGE).int()  # the new tokens are text
    with torch.no_grad():
        return model(input_ids=seq, attention_mask=full_mask, **kwargs).logits[:, -1]


def _eagle_head(model) -> EagleHead:
    torch.manual_seed(0)
    head = EagleHead(hidden_size=32, vocab_size=VOCAB, num_attention_heads=4)
    return head.bind_target(model.get_input_embeddings(), model.get_output_embeddings())


# -- (1) target-only decoding == transformers generate ------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_target_only_equals_transformers_generate(vlms, family):
    model = vlms[family]
    ids, mask, inputs, _ = _prompts(model)
    generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                               do_sample=False, pad_token_id=PAD, return_dict_in_generate=True, output_logits=True,
                               **inputs)
    reference = generated.sequences[:, ids.shape[1]:]
    out = speculative_generate(VLMRunner(model), None, ids, mask, max_new_tokens=MAX_NEW, **inputs)
    assert torch.equal(out.sequences, reference)
    assert out.stats.target_calls == MAX_NEW
    assert max(len(set(row.tolist())) for row in reference) > 3  # not only repeats: the comparison means something
    # the logits too, step by step (tokens alone hardly notice small position errors in a tiny random model)
    runner = VLMRunner(model)
    logits = runner.prefill(ids, mask, **inputs).logits[:, -1]
    for step in range(MAX_NEW):
        assert torch.allclose(logits, generated.logits[step], atol=1e-5), f"step {step}"
        runner.begin_round()
        logits = runner.forward(reference[:, step:step + 1]).logits[:, 0]
        runner.commit(torch.zeros(2, 1, dtype=torch.long))


# -- (2) speculative decoding with any drafter == target-only ------------------------------------------------
DRAFTERS = {
    "text-lm-chain": lambda m: ModelDrafter(tiny_llama(vocab_size=VOCAB, layers=1, seed=5, dtype=torch.float32), 3,
                                            share_model_inputs=False),
    "text-lm-tree": lambda m: ModelDrafter(tiny_llama(vocab_size=VOCAB, layers=1, seed=5, dtype=torch.float32),
                                           tree=TreeConfig(depth=3, top_k=2, total_tokens=6), share_model_inputs=False),
    "eagle-chain": lambda m: EagleDrafter(_eagle_head(m), 3),
    "eagle-tree": lambda m: EagleDrafter(_eagle_head(m), tree=TreeConfig(depth=3, top_k=3, total_tokens=8)),
    "self-tree": lambda m: ModelDrafter(VLMRunner(m), tree=TreeConfig(depth=4, top_k=2, total_tokens=8)),
}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculation_is_lossless(vlms, family, drafter):
    model = vlms[family]
    ids, mask, inputs, _ = _prompts(model, seed=1)
    baseline = speculative_generate(VLMRunner(model), None, ids, mask, max_new_tokens=MAX_NEW, **inputs)
    target = VLMRunner(model, return_hidden=drafter.startswith("eagle"))
    spec = speculative_generate(target, DRAFTERS[drafter](model), ids, mask, max_new_tokens=MAX_NEW, **inputs)
    assert torch.equal(spec.sequences, baseline.sequences)
    assert spec.stats.draft_calls > 0
    if drafter == "self-tree":  # the VLM drafting itself (images included): its tree's top path is always right
        assert spec.stats.target_calls <= MAX_NEW // 4 + 2
        assert spec.stats.mean_accepted_length > 3.0


# -- (3) tree positions (M-RoPE: text + rope delta + depth on all axes) ------------------------------------
PARENTS = torch.tensor([[-1, -1, 0, 0, 2, 1]]).repeat(2, 1)


def _tree_round(runner, ids, mask, inputs, nodes):
    prefill = runner.prefill(ids, mask, **inputs)
    root = prefill.logits[:, -1].argmax(-1)
    runner.begin_round()
    prefix = torch.ones(2, PARENTS.shape[1] + 1, runner.num_slots, dtype=torch.bool)
    attention = torch.cat([prefix, tree_attention_mask(PARENTS)], 2)
    out = runner.forward(torch.cat([root.unsqueeze(1), nodes], 1), offsets=tree_position_offsets(PARENTS),
                         attention=attention)
    return root, out.logits


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_node_logits_equal_the_branch_decoded_in_full(vlms, family):
    model = vlms[family]
    ids, mask, inputs, _ = _prompts(model, seed=2)
    nodes = torch.randint(*WORDS, PARENTS.shape, generator=torch.Generator().manual_seed(3))
    root, logits = _tree_round(VLMRunner(model), ids, mask, inputs, nodes)
    for j in range(PARENTS.shape[1]):
        path, node = [], j
        while node >= 0:
            path.insert(0, node)
            node = int(PARENTS[0, node])
        branch = torch.cat([root.unsqueeze(1), nodes[:, path]], 1)
        reference = _full_logits(model, ids, mask, inputs, branch)
        assert torch.allclose(logits[:, j + 1], reference, atol=1e-4), f"node {j}"
    assert torch.allclose(logits[:, 0], _full_logits(model, ids, mask, inputs, root.unsqueeze(1)), atol=1e-4)
    if family.startswith("qwen"):  # control: without the rope deltas the same tree gives other logits
        runner = VLMRunner(model)
        runner.prefill(ids, mask, **inputs)
        assert runner.rope_deltas.abs().min() > 0
        original = VLMRunner.model_positions
        try:
            VLMRunner.model_positions = lambda self, p: p.unsqueeze(0).expand(3, -1, -1)
            _, wrong = _tree_round(runner, ids, mask, inputs, nodes)
        finally:
            VLMRunner.model_positions = original
        assert not torch.allclose(wrong[:, 1:], logits[:, 1:], atol=1e-3)


def test_tree_commit_then_decode_matches_the_kept_branch(vlms):
    """KV rollback: keep the branch root -> node 0 -> node 2 -> node 4, then the next step continues it."""
    model = vlms["qwen2_vl"]
    ids, mask, inputs, _ = _prompts(model, seed=4)
    nodes = torch.randint(*WORDS, PARENTS.shape, generator=torch.Generator().manual_seed(5))
    runner = VLMRunner(model)
    root, _ = _tree_round(runner, ids, mask, inputs, nodes)
    keep = torch.tensor([[0, 1, 3, 5], [0, 1, 3, 5]])  # input slots of root, nodes 0, 2, 4
    runner.commit(keep)
    runner.begin_round()
    nxt = torch.randint(*WORDS, (2, 1), generator=torch.Generator().manual_seed(6))
    logits = runner.forward(nxt).logits[:, 0]
    branch = torch.cat([root.unsqueeze(1), nodes[:, [0, 2, 4]], nxt], 1)
    assert torch.allclose(logits, _full_logits(model, ids, mask, inputs, branch), atol=1e-4)


# -- (4) what drafters read --------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_exposes_spans_embeddings_and_hidden_states(vlms, family):
    model = vlms[family]
    ids, mask, inputs, spans = _prompts(model, seed=7)
    runner = VLMRunner(model, return_hidden=True, return_penultimate=True)
    out = runner.prefill(ids, mask, **inputs)
    assert isinstance(out, VLMPrefillOutput)
    assert out.image_spans == spans
    assert torch.equal(out.image_mask, ids == IMAGE)
    # the model's own forward over the same prompt
    kwargs = dict(inputs)
    if family.startswith("llava"):
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp_min(0)  # HF's own forward ignores left padding
        sizes = (inputs["image_sizes"],) if family == "llava_next" else ()
        features = model.model.get_image_features(
            inputs["pixel_values"], *sizes, vision_feature_layer=model.config.vision_feature_layer,
            vision_feature_select_strategy=model.config.vision_feature_select_strategy).pooler_output
    else:
        features = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    features = torch.cat(list(features), 0)  # [total image tokens, D], row-major prompt order
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, **kwargs)
    image = ids == IMAGE
    # the prefill computes the last slot's logits only, unless asked for all of them (distillation)
    assert out.logits.shape == (2, 1, reference.logits.shape[-1])
    assert torch.allclose(out.logits, reference.logits[:, -1:], atol=1e-5)
    every = VLMRunner(model, prefill_logits="all").prefill(ids, mask, **inputs)
    assert torch.allclose(every.logits, reference.logits, atol=1e-5)
    # hidden states read by hooks equal output_hidden_states' (every slot)
    assert torch.allclose(out.hidden, reference.hidden_states[-1], atol=1e-5)
    assert torch.allclose(out.penultimate, reference.hidden_states[-2], atol=1e-5)
    # input embeddings: token embeddings on text, the vision features on image slots
    text_embeds = model.get_input_embeddings()(ids)
    assert torch.equal(out.inputs_embeds[~image], text_embeds[~image])
    assert torch.allclose(out.inputs_embeds[image], features, atol=1e-6)
    # packed per-row image tensors, in prompt order
    counts = image.sum(-1)
    assert out.image_token_mask.shape == (2, int(counts.max()))
    assert torch.equal(out.image_token_mask.sum(-1), counts)
    for b in range(2):
        n = int(counts[b])
        assert torch.allclose(out.image_hidden[b, :n], reference.hidden_states[-1][b][image[b]], atol=1e-5)
        assert torch.equal(out.image_embeds[b, :n], out.inputs_embeds[b][image[b]])
        assert (out.image_hidden[b, n:] == 0).all()
    if family.startswith("qwen"):
        positions, deltas = model.model.get_rope_index(ids, mm_token_type_ids=kwargs["mm_token_type_ids"],
                                                       image_grid_thw=inputs["image_grid_thw"], attention_mask=mask)
        assert torch.equal(out.position_ids, positions) and torch.equal(out.rope_deltas, deltas.reshape(-1))
    else:
        assert out.rope_deltas is None and out.position_ids.shape == ids.shape
    runner.begin_round()
    step = runner.forward(out.logits[:, -1].argmax(-1, keepdim=True))
    assert step.hidden.shape == step.penultimate.shape == (2, 1, 32)
    assert not torch.allclose(step.hidden, step.penultimate)


def test_mm_token_type_ids_are_rebuilt_when_missing(vlms):
    model = vlms["qwen2_vl"]
    ids, mask, inputs, _ = _prompts(model, seed=8)
    given = VLMRunner(model).prefill(ids, mask, **inputs)
    inputs.pop("mm_token_type_ids")
    without = VLMRunner(model).prefill(ids, mask, **inputs)
    assert torch.equal(without.logits, given.logits) and torch.equal(without.position_ids, given.position_ids)


def test_text_only_prompt_runs_with_zero_rope_deltas(vlms):
    model = vlms["qwen2_vl"]
    ids = torch.randint(*WORDS, (2, 6), generator=torch.Generator().manual_seed(9))
    out = speculative_generate(VLMRunner(model), None, ids, max_new_tokens=8)
    assert torch.equal(out.sequences, _generate(model, ids, torch.ones_like(ids), {}, n=8))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_video_and_image_rows_match_generate(vlms, family):
    """Row 0 holds an image, row 1 a two-frame video (M-RoPE time axis); logits equal generate's at every step."""
    model = vlms[family]
    g = torch.Generator().manual_seed(10)
    video_grid = torch.tensor([[2, 4, 4]])  # 2 temporal patches of 4x4 -> 8 tokens after the 2x2 merge
    image_grid = torch.tensor([[1, 4, 4]])
    row0 = [5, 6, VISION_START] + [IMAGE] * 4 + [VISION_END] + [7, 8, 9, 10, 11, 12, 13]
    row1 = [14, VISION_START] + [VIDEO] * 8 + [VISION_END] + [15, 16, 17, 18]
    ids = torch.full((2, len(row0)), PAD)
    ids[0] = torch.tensor(row0)
    ids[1, len(row0) - len(row1):] = torch.tensor(row1)
    mask = (torch.arange(len(row0)) >= torch.tensor([[0], [len(row0) - len(row1)]])).long()
    types = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    inputs = dict(pixel_values=torch.randn(16, 96, generator=g), image_grid_thw=image_grid,
                  pixel_values_videos=torch.randn(32, 96, generator=g), video_grid_thw=video_grid,
                  mm_token_type_ids=types)
    generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                               pad_token_id=PAD, return_dict_in_generate=True, output_logits=True, **inputs)
    runner = VLMRunner(model)
    prefill = runner.prefill(ids, mask, **inputs)
    assert prefill.image_spans == [[(3, 7)], [(len(row0) - len(row1) + 2, len(row0) - len(row1) + 10)]]
    assert prefill.image_mask.sum() == 12
    logits = prefill.logits[:, -1]
    for step, token in enumerate(generated.sequences[:, ids.shape[1]:].T):
        assert torch.allclose(logits, generated.logits[step], atol=1e-5), f"step {step}"
        runner.begin_round()
        logits = runner.forward(token.unsqueeze(1)).logits[:, 0]
        runner.commit(torch.zeros(2, 1, dtype=torch.long))


# -- (5) bad input --------------------------------------------------------------------------------------------
def test_bad_inputs_are_clear_errors(vlms):
    ids, mask, inputs, _ = _prompts(vlms["llava"])
    llava = VLMRunner(vlms["llava"])
    with pytest.raises(ValueError, match="no pixel_values"):
        llava.prefill(ids, mask)
    with pytest.raises(ValueError, match="pixel_values holds 2 image"):
        llava.prefill(ids, mask, pixel_values=inputs["pixel_values"][:2])
    with pytest.raises(ValueError, match="no image placeholder"):
        llava.prefill(torch.randint(*WORDS, (2, 5)), pixel_values=inputs["pixel_values"])
    with pytest.raises(ValueError, match="input_ids"):
        llava.prefill(None, mask, **inputs)
    llava.prefill(ids, mask, **inputs)
    llava.begin_round()
    with pytest.raises(ValueError, match="only be given to prefill"):
        llava.forward(ids[:, -1:], pixel_values=inputs["pixel_values"])

    ids, mask, inputs, _ = _prompts(vlms["llava_next"])
    llava_next = VLMRunner(vlms["llava_next"])
    with pytest.raises(ValueError, match="image_sizes"):
        llava_next.prefill(ids, mask, pixel_values=inputs["pixel_values"])
    with pytest.raises(ValueError, match="wrong image count"):
        llava_next.prefill(ids, mask, pixel_values=inputs["pixel_values"][:2], image_sizes=inputs["image_sizes"][:2])

    ids, mask, inputs, _ = _prompts(vlms["qwen2_vl"])
    qwen = VLMRunner(vlms["qwen2_vl"])
    with pytest.raises(ValueError, match="image_grid_thw"):
        qwen.prefill(ids, mask, pixel_values=inputs["pixel_values"])
    grid = inputs["image_grid_thw"]
    extra = torch.cat([grid, grid[:1]])  # one image more than the prompt has placeholders for
    pixels = torch.cat([inputs["pixel_values"], inputs["pixel_values"][: int(grid[0].prod())]])
    with pytest.raises(ValueError, match="wrong image count"):
        qwen.prefill(ids, mask, pixel_values=pixels, image_grid_thw=extra)
    with pytest.raises(ValueError, match="one row per patch"):
        qwen.prefill(ids, mask, pixel_values=inputs["pixel_values"], image_grid_thw=extra)
    swapped = grid[[1, 0, 2]]  # same total, wrong order: image 0 would straddle rows
    with pytest.raises(ValueError, match="not one contiguous run"):
        qwen.prefill(ids, mask, pixel_values=inputs["pixel_values"], image_grid_thw=swapped)
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        qwen.prefill(ids, mask, **{**inputs, "mm_token_type_ids": torch.zeros(2, 3, dtype=torch.int32)})

    with pytest.raises(ValueError, match="Qwen2VLForConditionalGeneration"):
        VLMRunner(tiny_llama(vocab_size=VOCAB))
    with pytest.raises(RuntimeError, match="prefill"):
        VLMRunner(vlms["qwen2_vl"]).model_positions(torch.zeros(2, 1, dtype=torch.long))
