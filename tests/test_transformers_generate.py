"""mmspec drafts inside transformers' own ``generate()`` (``custom_generate``): greedy output identical to plain
``generate()``, sampled output from the same distribution, streamers fed the prompt first."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from stats_utils import P_VALUE_FLOOR, two_sample_chi2_pvalue

from mmspec import speculative_custom_generate
from mmspec.methods.vlm_heads import VLMDraftConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def zoo_vlm():
    from mmspec.pipelines import VLMPipeline
    from mmspec.world import render_scene, sample_scene

    pipe = VLMPipeline.from_pretrained("mmspec/shapes-vlm")
    images = [render_scene(sample_scene(seed), image_size=64) for seed in (0, 1)]
    batch = pipe.encode(images, ["describe the image in detail.", "caption the image."])
    return pipe, batch.inputs


@pytest.mark.parametrize("head", ["flash_head", "eagle_head", "draft_model"])
def test_greedy_generate_with_a_draft_equals_plain_generate(zoo_vlm, head):
    pipe, inputs = zoo_vlm
    plain = pipe.target.generate(**inputs, max_new_tokens=48, do_sample=False)
    fast = pipe.target.generate(**inputs, max_new_tokens=48, do_sample=False, custom_generate=speculative_custom_generate,
                                draft_model=getattr(pipe, head), draft_config=VLMDraftConfig(num_draft_tokens=8))
    assert torch.equal(fast, plain)


def test_sampled_generate_with_a_draft_follows_the_same_distribution():
    """4,000 rows of two sampled tokens (temperature 0.8, top-k 12, top-p 0.9), plain vs speculative: a
    chi-square homogeneity test of the joint (first, second) token pairs, p >= 1e-4 (fixed seeds)."""
    target, draft = tiny_llama(layers=2, seed=0, dtype=torch.float32), tiny_llama(layers=1, seed=1, dtype=torch.float32)
    prompt = torch.tensor([[1, 5, 9, 3]]).repeat(4000, 1)
    settings = dict(max_new_tokens=2, do_sample=True, temperature=0.8, top_k=12, top_p=0.9, pad_token_id=0,
                    eos_token_id=None)
    torch.manual_seed(0)
    plain = target.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)[:, 4:]
    torch.manual_seed(1)
    fast = target.generate(prompt, attention_mask=torch.ones_like(prompt), custom_generate=speculative_custom_generate,
                           draft_model=draft, draft_config=VLMDraftConfig(num_draft_tokens=3), **settings)[:, 4:]
    assert fast.shape == plain.shape == (4000, 2)
    pairs = lambda tokens: (tokens[:, 0] * 32 + tokens[:, 1]).numpy()  # noqa: E731
    assert two_sample_chi2_pvalue(pairs(plain), pairs(fast)) >= P_VALUE_FLOOR
    assert not torch.equal(plain, fast)  # two independent samples, not one copied


def test_streamer_gets_the_prompt_first_so_skip_prompt_keeps_the_whole_answer(zoo_vlm):
    from transformers import TextStreamer

    pipe, inputs = zoo_vlm
    one = {key: value[:1] if key in ("input_ids", "attention_mask") else value for key, value in inputs.items()}
    one["pixel_values"] = inputs["pixel_values"][:1]
    printed: list[str] = []

    class Collect(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            printed.append(text)

    streamer = Collect(pipe.tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = pipe.target.generate(**one, max_new_tokens=32, do_sample=False, custom_generate=speculative_custom_generate,
                               draft_model=pipe.flash_head, speculative_streamer=streamer)
    answer = pipe.tokenizer.decode(out[0, one["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "".join(printed).strip() == answer.strip() and answer.split()[0] in "".join(printed)


@pytest.mark.parametrize("settings, match", [
    ({"repetition_penalty": 1.3}, "RepetitionPenaltyLogitsProcessor"),
    ({"num_beams": 2}, "num_beams"),
    ({"max_time": 30.0}, "MaxTimeCriteria"),
])
def test_settings_the_loop_cannot_reproduce_are_refused(zoo_vlm, settings, match):
    pipe, inputs = zoo_vlm
    kwargs = dict(max_new_tokens=8, do_sample=False, custom_generate=speculative_custom_generate,
                  draft_model=pipe.flash_head, **settings)
    with pytest.raises(ValueError, match=match):
        pipe.target.generate(**inputs, **kwargs)


def test_a_draft_is_required_and_must_share_the_vocabulary(zoo_vlm):
    pipe, inputs = zoo_vlm
    with pytest.raises(ValueError, match="draft_model="):
        pipe.target.generate(**inputs, max_new_tokens=4, custom_generate=speculative_custom_generate)
    with pytest.raises(ValueError, match="share a tokenizer"):
        pipe.target.generate(**inputs, max_new_tokens=4, custom_generate=speculative_custom_generate,
                             draft_model=tiny_llama(dtype=torch.float32))


@pytest.mark.parametrize("draft", ["foo", 3, torch.zeros(2)])
def test_a_draft_model_that_is_no_model_is_refused_by_name(zoo_vlm, draft):
    pipe, inputs = zoo_vlm
    with pytest.raises(TypeError, match=f"draft_model must be an mmspec draft head .*got {type(draft).__name__}"):
        pipe.target.generate(**inputs, max_new_tokens=4, custom_generate=speculative_custom_generate,
                             draft_model=draft)


def test_generation_past_a_models_position_limit_is_refused(zoo_vlm, monkeypatch):
    """As in VLMPipeline: the prompt plus max_new_tokens must fit the target's and the draft's
    max_position_embeddings, checked before any forward (past it a model answers nonsense without error)."""
    from mmspec.validation import max_position_embeddings

    pipe, inputs = zoo_vlm
    limit = max_position_embeddings(pipe.target)
    prompt = int(inputs["attention_mask"].sum(-1).max())
    with pytest.raises(ValueError, match=f"max_new_tokens={limit - prompt + 1} more, but the target's "
                                         f"max_position_embeddings is {limit}"):
        pipe.target.generate(**inputs, max_new_tokens=limit - prompt + 1, custom_generate=speculative_custom_generate,
                             draft_model=pipe.flash_head)
    # a draft with a shorter limit than the target's bounds the generation too
    config = pipe.flash_head.config
    if isinstance(config, dict):
        monkeypatch.setitem(config, "max_position_embeddings", prompt + 8)
    else:
        monkeypatch.setattr(config, "max_position_embeddings", prompt + 8)
    assert max_position_embeddings(pipe.flash_head) == prompt + 8
    with pytest.raises(ValueError, match="max_new_tokens=9 more, but the draft_model's max_position_embeddings"):
        pipe.target.generate(**inputs, max_new_tokens=9, custom_generate=speculative_custom_generate,
                             draft_model=pipe.flash_head)


def test_qwen2_vl_through_generate_is_refused_with_the_reason():
    """Qwen2-VL's M-RoPE positions need the image grid, which generate() drops before a custom_generate runs:
    a clear NotImplementedError, not a wrong answer."""
    from test_vlm_drafters import _build, _prompts

    from mmspec.models.eagle import EagleHead

    target = _build("qwen2_vl")
    ids, mask, image_inputs, _ = _prompts("qwen2_vl")
    text = target.config.get_text_config()
    head = EagleHead(hidden_size=text.hidden_size, vocab_size=text.vocab_size, intermediate_size=64)
    with pytest.raises(NotImplementedError, match="M-RoPE.*VLMPipeline"):
        target.generate(ids, attention_mask=mask, **image_inputs, max_new_tokens=4, do_sample=False,
                        custom_generate=speculative_custom_generate, draft_model=head)
