"""MuLo-SD modules (up-sampler, down-sampler, drafter) and ARImagePipeline(method="mulo")."""

from __future__ import annotations

import pytest
import torch
from test_ar_image_pipeline import COND, GRID, PROMPTS, WORDS, V, copy_head, tiny_transformer, tiny_vq

from mmspec.methods.mulo import MuLoConfig
from mmspec.models.llamagen import LlamaGenTransformer
from mmspec.models.mulo import MuLoDrafter, TokenUpsampler, downsample_tokens
from mmspec.models.text import WordTokenizer
from mmspec.pipelines import ARImagePipeline
from mmspec.rules import GreedyRule, LanternRule
from mmspec.runner import GuidedRunner


def tiny_low_res(seed: int = 5) -> LlamaGenTransformer:
    torch.manual_seed(seed)
    return LlamaGenTransformer(dim=16, n_layer=1, n_head=2, multiple_of=16, vocab_size=V, block_size=(GRID // 2) ** 2,
                               model_type="t2i", cls_token_num=COND, caption_dim=8, text_vocab_size=len(WORDS)
                               ).double().eval()


def tiny_upsampler(seed: int = 6, high_res_context: bool = False) -> TokenUpsampler:
    torch.manual_seed(seed)
    return TokenUpsampler(vocab_size=V, ratio=2, dim=16, high_res_context=high_res_context).eval()


def mulo_pipe() -> ARImagePipeline:
    pipe = ARImagePipeline(tiny_transformer(), tiny_vq(), copy_head(), WordTokenizer(WORDS),
                           mulo_drafter=tiny_low_res(), mulo_upsampler=tiny_upsampler())
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe() -> ARImagePipeline:
    return mulo_pipe()


def test_upsampler_is_row_causal_and_shapes():
    up = tiny_upsampler()
    low = torch.randint(0, V, (2, 3, 3), generator=torch.Generator().manual_seed(0))
    logits = up(low)
    assert logits.shape == (2, 6, 6, V)
    changed = low.clone()
    changed[:, 2] = (changed[:, 2] + 1) % V  # the last low-res row
    other = up(changed)
    assert torch.allclose(other[:, :4], logits[:, :4])  # rows from low-res rows 0-1 do not see row 2
    assert not torch.allclose(other[:, 4:], logits[:, 4:])


def test_upsampler_high_res_context_reads_only_the_blocks_above():
    """``high_res_context=True``: block i's logits change with the high-res rows of blocks < i and never with
    its own rows or those below; a no-context up-sampler refuses high-res tokens, a context one needs them."""
    up = tiny_upsampler(high_res_context=True)
    gen = torch.Generator().manual_seed(0)
    low = torch.randint(0, V, (2, 3, 3), generator=gen)
    high = torch.randint(0, V, (2, 6, 6), generator=gen)
    logits = up(low, high)
    assert logits.shape == (2, 6, 6, V)
    for block in range(3):
        changed = high.clone()
        changed[:, 2 * block:2 * block + 2] = (changed[:, 2 * block:2 * block + 2] + 1) % V
        other = up(low, changed)
        assert torch.allclose(other[:, :2 * block + 2], logits[:, :2 * block + 2])  # blocks <= i: unchanged
        if block < 2:
            assert not torch.allclose(other[:, 2 * block + 2:], logits[:, 2 * block + 2:])  # the blocks below read it
    with pytest.raises(ValueError, match=r"high_tokens must be a LongTensor \[2, 6, 6\]"):
        up(low)
    with pytest.raises(ValueError, match="high_tokens must be a LongTensor"):
        up(low, high[:, :4])
    with pytest.raises(ValueError, match="high_tokens must lie in"):
        up(low, high + V)
    with pytest.raises(ValueError, match="reads no high-res context"):
        tiny_upsampler()(low, high)


def test_drafter_gives_a_context_upsampler_the_final_blocks_above():
    """MuLoDrafter hands a ``high_res_context`` up-sampler the committed (final) high-res blocks above the
    drafted one; the pipeline then runs, and reverify with the exact rule stays lossless."""
    up = tiny_upsampler(high_res_context=True)
    seen = []
    forward = up.forward
    up.forward = lambda low, high=None: seen.append(high) or forward(low, high)
    drafter = MuLoDrafter(tiny_low_res(), up, tiny_vq())
    words = WordTokenizer(WORDS).batch(PROMPTS, COND)
    drafter.prefill((words >= 0).long(), condition_ids=words)
    finals = []
    for block in range(GRID // 2):
        tokens, _ = drafter.propose(block)
        assert seen[-1].shape == (3, 2 * block + 2, GRID)
        if finals:
            assert torch.equal(seen[-1][:, :2 * block], torch.cat(finals, 1))
        final = torch.randint(0, V, tokens.shape, generator=torch.Generator().manual_seed(block))
        drafter.commit(block, final)
        finals.append(final.view(3, 2, GRID))
    pipe = ARImagePipeline(tiny_transformer(), tiny_vq(), None, WordTokenizer(WORDS), mulo_drafter=tiny_low_res(),
                           mulo_upsampler=tiny_upsampler(high_res_context=True))
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(do_sample=False, guidance_scale=3.0, output_type="tokens")
    out = pipe(PROMPTS, method=MuLoConfig(resample="reverify"), rule=GreedyRule(), **kwargs)
    assert torch.equal(out.tokens, pipe(PROMPTS, method="none", **kwargs).tokens)


def test_drafter_unguided_beside_a_guided_target_reads_the_conditional_rows(pipe):
    """``guided_prompt=True`` with guidance 1: the drafter reads the conditional half of a guided prompt batch
    and drafts what it drafts from the conditional rows alone (guided, it drafts otherwise); the pipeline's
    ``MuLoConfig(guidance_scale=1)`` under guidance stays lossless with reverify and the exact rule."""
    words = WordTokenizer(WORDS).batch(PROMPTS, COND)
    mask, drop = (words >= 0).long(), GuidedRunner.condition_drop(len(PROMPTS), "cpu")
    doubled = dict(attention_mask=torch.cat([mask, mask]), condition_ids=torch.cat([words, words]), condition_drop=drop)

    def first_block(drafter: MuLoDrafter, attention_mask: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        drafter.prefill(attention_mask, **inputs)
        return drafter.propose(0)[0]

    alone = first_block(MuLoDrafter(tiny_low_res(), tiny_upsampler(), tiny_vq()), mask, condition_ids=words)
    half = first_block(MuLoDrafter(tiny_low_res(), tiny_upsampler(), tiny_vq(), guided_prompt=True), **doubled)
    guided = first_block(MuLoDrafter(tiny_low_res(), tiny_upsampler(), tiny_vq(), guidance_scale=3.0), **doubled)
    assert torch.equal(half, alone) and not torch.equal(guided, alone)
    kwargs = dict(do_sample=False, guidance_scale=3.0, output_type="tokens")
    out = pipe(PROMPTS, method=MuLoConfig(resample="reverify", guidance_scale=1.0), rule=GreedyRule(), **kwargs)
    assert torch.equal(out.tokens, pipe(PROMPTS, method="none", **kwargs).tokens)
    with pytest.raises(ValueError, match="guided prompt rows"):
        MuLoDrafter(tiny_low_res(), tiny_upsampler(), tiny_vq(), guidance_scale=3.0, guided_prompt=False)
    with pytest.raises(ValueError, match="needs a guided target"):
        pipe(PROMPTS, method=MuLoConfig(guidance_scale=3.0), guidance_scale=1.0)
    with pytest.raises(TypeError, match=r"mulo_guidance_scale -> MuLoConfig.guidance_scale"):
        pipe(PROMPTS, method="eagle", mulo_guidance_scale=1.0)  # a MuLo-SD setting, not EAGLE's
    with pytest.raises(ValueError, match="MuLoConfig.guidance_scale must be a number in .* finite"):
        MuLoConfig(guidance_scale=-1.0)


def test_downsampler_goes_through_pixels():
    vq = tiny_vq()
    tokens = torch.randint(0, V, (2, GRID, GRID), generator=torch.Generator().manual_seed(1))
    low = downsample_tokens(vq, tokens, 2)
    assert low.shape == (2, GRID // 2, GRID // 2)
    expected = vq.encode(torch.nn.functional.avg_pool2d(vq.decode(tokens), 2))
    assert torch.equal(low, expected)


def test_drafter_cache_holds_the_final_low_res_rows():
    """After each commit the drafter's next-token logits equal a fresh teacher-forced pass over the
    down-sampled final rows (its own drafted row is replaced, not kept)."""
    low_model, vq = tiny_low_res(), tiny_vq()
    drafter = MuLoDrafter(low_model, tiny_upsampler(), vq)
    words = WordTokenizer(WORDS).batch(PROMPTS, COND)
    drafter.prefill((words >= 0).long(), condition_ids=words)
    finals = []
    for block in range(GRID // 2):
        tokens, probs = drafter.propose(block)
        assert tokens.shape == (3, 2 * GRID) and probs is None
        final = torch.randint(0, V, tokens.shape, generator=torch.Generator().manual_seed(block))
        drafter.commit(block, final)
        finals.append(downsample_tokens(vq, final.view(3, 2, GRID), 2)[:, 0])
        low = torch.cat(finals, 1)
        if low.shape[1] < low_model.config.block_size:
            with torch.no_grad():
                expected = low_model.forward_train(words, torch.cat([low, low[:, :1]], 1),
                                                   torch.zeros(3, dtype=torch.bool),
                                                   condition_mask=(words >= 0).long())[:, low.shape[1]]
            assert torch.allclose(drafter._next_logits, expected, atol=1e-6)
    with pytest.raises(ValueError, match="past its grid"):
        drafter.propose(GRID // 2)


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_pipeline_mulo_runs_batched_and_counts_one_target_pass_per_block(pipe, guidance_scale):
    parallel = MuLoConfig(resample="parallel")  # the paper's resampling: one target pass per block
    out = pipe(PROMPTS, method=parallel, do_sample=False, guidance_scale=guidance_scale, num_images_per_prompt=2,
               output_type="np")
    assert out.tokens.shape == (6, GRID, GRID) and out.images.shape == (6, 2 * GRID, 2 * GRID, 3)
    assert out.stats.target_calls == 1 + GRID // 2
    assert out.stats.draft_calls == (GRID // 2) ** 2  # w forwards per low-res row (w - 1 drafting, 1 commit)
    again = pipe(PROMPTS, method=parallel, do_sample=False, guidance_scale=guidance_scale, num_images_per_prompt=2,
                 output_type="tokens")
    assert torch.equal(again.tokens, out.tokens)
    # rows of the same prompt are identical under greedy decoding, different prompts differ
    assert torch.equal(out.tokens[0], out.tokens[1])


def test_pipeline_mulo_sampling_and_rule_composition(pipe):
    parallel = MuLoConfig(resample="parallel")
    a = pipe(PROMPTS, method=parallel.replace(tau=1e-9), generator=torch.Generator().manual_seed(0),
             output_type="tokens")
    assert a.drafted.all()  # a threshold of (almost) 0 keeps every draft
    b = pipe(PROMPTS, method=parallel.replace(tau=1.0), generator=torch.Generator().manual_seed(0),
             output_type="tokens")
    assert (~b.drafted).any()
    lantern = LanternRule(pipe.codebook_neighbors(4), k=4, delta=0.2)
    c = pipe(PROMPTS, method=parallel, rule=lantern, generator=torch.Generator().manual_seed(0), output_type="tokens")
    assert c.tokens.shape == (3, GRID, GRID)


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_pipeline_mulo_sequential_resampling_of_everything_equals_target_only(pipe, guidance_scale):
    """``resample="sequential"`` with tau above any pooled mass rejects every draft and redraws the whole
    block in raster order given the final tokens: greedy output is target-only decoding's exactly."""
    kwargs = dict(do_sample=False, guidance_scale=guidance_scale, output_type="tokens")
    expected = pipe(PROMPTS, method="none", **kwargs).tokens
    strict = MuLoConfig(tau=1.0, k=1, radius=0)
    out = pipe(PROMPTS, method=strict.replace(resample="sequential"), **kwargs)
    assert not out.drafted.any()  # the tiny target never puts all its mass on a code and its neighbour
    assert torch.equal(out.tokens, expected)
    parallel = pipe(PROMPTS, method=strict.replace(resample="parallel"), **kwargs)
    assert not torch.equal(parallel.tokens, expected)  # each token there saw the drafts around it
    with pytest.raises(ValueError, match="MuLoConfig.resample must be one of"):
        MuLoConfig(resample="bogus")


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_pipeline_mulo_reverify_with_the_exact_rule_is_lossless(pipe, guidance_scale):
    """``resample="reverify"`` (MuLoConfig's default) with the exact (greedy) rule: MuLo-SD drafts, target-only tokens. With the
    pooled rule it keeps more drafts and needs fewer target calls than one per token."""
    kwargs = dict(do_sample=False, guidance_scale=guidance_scale, output_type="tokens")
    expected = pipe(PROMPTS, method="none", **kwargs).tokens
    out = pipe(PROMPTS, method="mulo", rule=GreedyRule(), **kwargs)
    assert torch.equal(out.tokens, expected)
    assert out.stats.target_calls <= 1 + GRID * GRID
    pooled = pipe(PROMPTS, method=MuLoConfig(resample="reverify", tau=0.05), **kwargs)
    assert pooled.drafted.sum() >= out.drafted.sum()
    assert pooled.stats.target_calls < 1 + GRID * GRID


def test_pipeline_save_and_load_keeps_the_mulo_components(pipe, tmp_path):
    pipe.save_pretrained(tmp_path)
    loaded = ARImagePipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert isinstance(loaded.mulo_upsampler, TokenUpsampler)
    kwargs = dict(method="mulo", do_sample=False, output_type="tokens")
    assert torch.equal(loaded(PROMPTS, **kwargs).tokens, pipe(PROMPTS, **kwargs).tokens)


def test_mulo_component_errors():
    with pytest.raises(ValueError, match="come together"):
        ARImagePipeline(tiny_transformer(), tiny_vq(), None, WordTokenizer(WORDS), mulo_drafter=tiny_low_res())
    big = LlamaGenTransformer(dim=16, n_layer=1, n_head=2, multiple_of=16, vocab_size=V, block_size=GRID * GRID,
                              model_type="t2i", cls_token_num=COND, caption_dim=8, text_vocab_size=len(WORDS))
    with pytest.raises(ValueError, match="grid"):
        ARImagePipeline(tiny_transformer(), tiny_vq(), None, WordTokenizer(WORDS), mulo_drafter=big,
                        mulo_upsampler=tiny_upsampler())
    plain = ARImagePipeline(tiny_transformer(), tiny_vq(), None, WordTokenizer(WORDS))
    with pytest.raises(ValueError, match="needs mulo_drafter"):
        plain("a circle", method="mulo")
    with pytest.raises(ValueError, match=r"MuLoConfig.k must be at most the image vocabulary minus one"):
        mulo_pipe()("a circle", method=MuLoConfig(k=V))
    with pytest.raises(ValueError, match="low_tokens"):
        tiny_upsampler()(torch.zeros(1, 2, 2))
