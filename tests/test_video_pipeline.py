"""ARVideoPipeline (pipelines/ar_video.py) on tiny random fp64 models: tau = +inf is target-only and
tau = -inf is draft-only exactly, accepted blocks enter the target's cache and condition its next block,
per-block statistics, the reward callables (shapes exact on world videos; CLIP and ImageReward from local
random weights), save/load, GIF export, bad input."""

from __future__ import annotations

import importlib.util
import json
import math
import warnings
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from pipeline_utils import assert_same_across_instances

from mmspec.methods.sdvg import DraftConfig, SDVGConfig
from mmspec.models.rewards import ScorerFrameReward, ShapesFrameReward, parse_video_prompt
from mmspec.models.text import WordTokenizer
from mmspec.models.tokenizers import load_zoo_tokenizer
from mmspec.models.video import BlockCausalVideoTransformer
from mmspec.pipelines.ar_video import ARVideoPipeline, VideoSpecStats, export_video, resolve_reward
from mmspec.world import (
    clip_for_prompt,
    make_video_prompt_set,
    render_video,
    score_video,
    vocabulary,
)
from mmspec.world.video import VideoPrompt, video_prompt_text

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["a red circle moving right", "a blue square moving up and a green diamond moving down and to the left"]


def tiny(layers: int, seed: int, dim: int = 32) -> BlockCausalVideoTransformer:
    torch.manual_seed(seed)
    model = BlockCausalVideoTransformer(num_layers=layers, dim=dim, num_heads=4, num_frames=8, text_length=20)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    return model.to(torch.float64).eval()


@pytest.fixture(scope="module")
def pipe():
    p = ARVideoPipeline(tiny(2, 0), load_zoo_tokenizer("continuous"), tiny(1, 1, dim=16), WordTokenizer(vocabulary()))
    p.set_progress_bar_config(disable=True)
    return p


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class BlockReward:
    """A reward that scores block n of every video with ``scores[row][n]`` (any callable works)."""

    def __init__(self, scores: list[list[float]], frames_per_block: int = 2) -> None:
        self.scores, self.fb, self.calls = scores, frames_per_block, []

    def __call__(self, frames, prompt):
        assert frames.ndim == 4 and frames.shape[1] == 3 and 0 <= float(frames.min()) and float(frames.max()) <= 1
        self.calls.append(prompt)
        row = [p for p in PROMPTS].index(prompt)
        block = sum(1 for p in self.calls if p == prompt)  # calls so far for this video = block index (first forced)
        return [self.scores[row][block]] * frames.shape[0]


def test_tau_plus_inf_is_target_only_exactly(pipe):
    base = pipe(PROMPTS, "none", generator=gen(), output_type="pt")
    spec = pipe(PROMPTS, SDVGConfig(tau=math.inf), generator=gen(), output_type="pt")
    assert torch.equal(base.latents, spec.latents) and torch.equal(base.frames, spec.frames)
    assert spec.stats.draft_calls == 0 and spec.stats.reward_calls == 0  # the decision needs no draft
    assert spec.stats.target_calls == base.stats.target_calls == 1 + 4 * 4  # prompt, 4 steps x 4 blocks (writes ride along)
    assert not spec.stats.accepted.any() and spec.stats.source == [["target"] * 4] * 2
    other = pipe(PROMPTS, "none", generator=gen(1), output_type="pt")
    assert not torch.allclose(other.latents, base.latents)  # the seed matters


def test_tau_minus_inf_is_draft_only_exactly(pipe):
    draft = pipe(PROMPTS, "draft", generator=gen(), output_type="pt")
    spec = pipe(PROMPTS, SDVGConfig(tau=-math.inf, force_reject_first=False), generator=gen(), output_type="pt")
    assert torch.equal(draft.latents, spec.latents)
    assert spec.stats.target_calls == 0 and draft.stats.target_calls == 0  # the target never runs
    assert spec.stats.accepted.all() and spec.stats.draft_fraction == 1.0
    base = pipe(PROMPTS, "none", generator=gen(), output_type="pt")
    assert not torch.allclose(base.latents, draft.latents)
    # with the forced first block: block 0 is the target's, the rest the drafter's
    anchored = pipe(PROMPTS, SDVGConfig(tau=-math.inf), generator=gen(), output_type="pt")
    assert anchored.stats.source == [["target", "draft", "draft", "draft"]] * 2
    assert torch.equal(anchored.latents[:, :2], base.latents[:, :2])


def test_accepted_blocks_enter_the_target_cache(pipe):
    # video 0: blocks 1 and 2 accepted, 3 rejected; video 1: block 1 rejected, 2 and 3 accepted
    reward = BlockReward([[None, 1.0, 1.0, 0.0], [None, 0.0, 1.0, 1.0]])
    seen = {}

    def on_block(p, n, timestep, info):
        cache = info["target_cache"]
        seen[n] = (cache.num_frames, cache.kv.keys[:, :, :, :cache.length].clone(), info["latents"].clone())
        return info

    out = pipe(PROMPTS, SDVGConfig(tau=0.5, reward=reward), generator=gen(), output_type="latent",
               callback_on_step_end=on_block)
    assert out.frames is None
    assert out.stats.source == [["target", "draft", "draft", "target"], ["target", "target", "draft", "draft"]]
    # lazy cache: the target caught up only when it ran: block 1 (video 1) needed block 0; block 2 (no
    # rejection) left it alone; block 3 (video 0) needed blocks 0-2, written in one pass
    assert [seen[n][0] for n in range(4)] == [0, 2, 2, 6]
    # each of those catch-ups was a pass of its own (the target regenerated one video of two)
    assert out.stats.target_calls == 1 + 4 + (1 + 4) + (1 + 4)
    # the cached keys of blocks 0-2 are those of the final video (accepted drafts included): rebuild them
    target = pipe.transformer
    ids = pipe.encode_prompt(PROMPTS)
    with torch.no_grad():
        fresh = target.new_cache(2)
        target.encode_prompt(fresh, ids)
        target.write_cache(out.latents[:, :6], fresh, 0)
    assert torch.allclose(seen[3][1], fresh.kv.keys[:, :, :, :fresh.length], atol=1e-10)
    # the target's block 3 of video 0 conditions on the accepted drafts: regenerate it by hand
    noise = torch.Generator().manual_seed(0)
    blocks = [torch.randn((4, 2, 2, 16, 8, 8), generator=noise) for _ in range(4)]
    from mmspec.models.video import denoise_block

    expected = denoise_block(target, fresh, 6, blocks[3][:, 0:1].double(), [1000, 750, 500, 250],
                             rows=torch.tensor([0]))
    assert torch.allclose(out.latents[0:1, 6:8], expected, atol=1e-10)
    # eager writes: the accepted block is in the target's cache right after its block
    eager = {}
    eager_config = SDVGConfig(tau=0.5, reward=BlockReward([[None, 1.0, 1.0, 0.0], [None, 0.0, 1.0, 1.0]]),
                              lazy_target_cache=False)
    pipe(PROMPTS, eager_config, generator=gen(), output_type="latent",
         callback_on_step_end=lambda p, n, t, info: eager.setdefault(n, info["target_cache"].num_frames) and info)
    assert eager == {0: 2, 1: 4, 2: 6, 3: 6}
    # both videos reject block 3: its first target pass also writes the accepted blocks 1-2 (no pass of their own)
    both = pipe(PROMPTS, SDVGConfig(tau=0.5, reward=BlockReward([[None, 1.0, 1.0, 0.0]] * 2)), generator=gen(),
                output_type="latent")
    assert both.stats.source == [["target", "draft", "draft", "target"]] * 2
    assert both.stats.target_calls == 1 + 4 + 4
    with torch.no_grad():
        cache = target.new_cache(2)
        target.encode_prompt(cache, ids)
        target.write_cache(both.latents[:, :6], cache, 0)
    expected = denoise_block(target, cache, 6, blocks[3].double(), [1000, 750, 500, 250])
    assert torch.allclose(both.latents[:, 6:8], expected, atol=1e-10)


def test_context_frames_extend_a_video(pipe):
    context = torch.rand(2, 2, 3, 32, 32, generator=gen(5), dtype=torch.float64)  # one block per video
    base = pipe(PROMPTS, "none", context_frames=context, generator=gen(), output_type="pt")
    assert base.stats.source == [["context", "target", "target", "target"]] * 2
    assert base.stats.tokens == 2 * 6 and base.frames.shape[1] == 8  # 6 generated frames per video, 8 returned
    latents = pipe.vae.encode(context.flatten(0, 1).float()).permute(0, 3, 1, 2).unflatten(0, (2, 2))
    assert torch.allclose(base.latents[:, :2], latents.double())  # the context's latents come first
    # block 1 is the target's continuation of the context, from the first noise drawn
    from mmspec.models.video import denoise_block

    target = pipe.transformer
    with torch.no_grad():
        cache = target.new_cache(2)
        target.encode_prompt(cache, pipe.encode_prompt(PROMPTS))
        target.write_cache(base.latents[:, :2], cache, 0)
    noise = torch.randn((4, 2, 2, 16, 8, 8), generator=gen())
    expected = denoise_block(target, cache, 2, noise.double(), [1000, 750, 500, 250])
    assert torch.allclose(base.latents[:, 2:4], expected, atol=1e-10)
    fresh_start = pipe(PROMPTS, "none", generator=gen(), output_type="pt")
    assert not torch.allclose(base.latents[:, 2:4], fresh_start.latents[:, 2:4])
    # the exactness of tau = +-inf holds with a context; no block is forced to the target after one
    spec = pipe(PROMPTS, SDVGConfig(tau=math.inf), context_frames=context, generator=gen(), output_type="pt")
    assert torch.equal(spec.latents, base.latents)
    draft = pipe(PROMPTS, "draft", context_frames=context, generator=gen(), output_type="pt")
    accept_all = pipe(PROMPTS, SDVGConfig(tau=-math.inf), context_frames=context, generator=gen(), output_type="pt")
    assert torch.equal(accept_all.latents, draft.latents) and accept_all.stats.target_calls == 0
    assert accept_all.stats.source == [["context", "draft", "draft", "draft"]] * 2
    assert not accept_all.stats.routed[:, 0].any() and accept_all.stats.routed[:, 1:].all()
    # one context per prompt is shared by that prompt's videos
    shared = pipe(PROMPTS, "none", num_videos_per_prompt=2, context_frames=context, generator=gen(), output_type="pt")
    assert torch.allclose(shared.latents[[0, 1, 2, 3], :2], latents.double()[[0, 0, 1, 1]])
    bad = {"channels": context[:, :, :2], "size": context[..., :16], "not a whole block": context[:, :1],
           "no block left": torch.rand(2, 8, 3, 32, 32, dtype=torch.float64), "range": context * 2,
           "rows": context[[0, 0, 1]]}
    for frames in bad.values():
        with pytest.raises(ValueError, match="context_frames"):
            pipe(PROMPTS, "none", context_frames=frames, generator=gen(), output_type="latent")
    with pytest.raises(ValueError, match="context_frames"):
        pipe(PROMPTS, "none", context_frames=context.numpy(), output_type="latent")


def test_per_block_stats(pipe):
    scores = [[None, 0.9, 0.2, 0.6], [None, 0.1, 0.7, 0.5]]
    reward = BlockReward(scores)
    out = pipe(PROMPTS, SDVGConfig(tau=0.55, reward=reward), generator=gen(), output_type="latent")
    stats = out.stats
    assert isinstance(stats, VideoSpecStats) and stats.tokens == 2 * 8
    expected_accept = [[False, True, False, True], [False, False, True, False]]
    assert stats.accepted.tolist() == expected_accept
    assert stats.routed.tolist() == [[False, True, True, True]] * 2
    assert stats.scored.tolist() == [[False, True, True, True]] * 2
    assert torch.isnan(stats.block_scores[:, 0]).all()
    assert stats.block_scores[:, 1:].tolist() == [[0.9, 0.2, 0.6], [0.1, 0.7, 0.5]]
    assert torch.isnan(stats.frame_rewards[:, :2]).all() and stats.frame_rewards[0, 2:4].tolist() == [0.9, 0.9]
    assert stats.reward_calls == 6 and stats.acceptance_rate == pytest.approx(3 / 6)
    assert stats.draft_fraction == pytest.approx(3 / 8)
    assert stats.draft_calls > 0 and stats.target_calls > 0 and stats.phase_seconds["reward"] >= 0
    summary = stats.as_dict()
    assert summary["acceptance_rate"] == pytest.approx(0.5) and summary["source"][0][1] == "draft"
    json.dumps(summary)  # JSON-able


def test_worst_frame_versus_mean(pipe):
    def alternating(frames, prompt):  # frame scores 0.0 and 1.0
        return [float(i % 2) for i in range(frames.shape[0])]

    worst = pipe(PROMPTS[:1], SDVGConfig(tau=0.4, reward=alternating), generator=gen(), output_type="latent")
    mean = pipe(PROMPTS[:1], SDVGConfig(tau=0.4, reward=alternating, aggregate="mean"), generator=gen(),
                output_type="latent")
    assert not worst.stats.accepted.any() and worst.stats.block_scores[0, 1:].tolist() == [0.0] * 3
    assert mean.stats.accepted[0, 1:].all() and mean.stats.block_scores[0, 1:].tolist() == [0.5] * 3


def test_shapes_reward_is_exact_on_world_videos():
    reward = ShapesFrameReward()
    for i, prompt in enumerate(make_video_prompt_set(6)):
        frames = render_video(clip_for_prompt(prompt, i, num_frames=4))  # uint8 [4, 32, 32, 3]
        tensor = torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255.0
        scores = reward(tensor, prompt.text)
        assert scores == score_video(frames, prompt).frame_scores == [1.0] * 4
        assert reward(tensor, prompt) == scores  # VideoPrompt objects work too
        match = ShapesFrameReward("match")(tensor, prompt.text)
        assert all(0.6 <= s <= 1.0 for s in match)
    # a frame without the objects scores 0, one with half of them 0.5
    blank = torch.zeros(2, 3, 32, 32)
    assert reward(blank, PROMPTS[0]) == [0.0, 0.0]
    two = make_video_prompt_set(2)[1]  # two objects
    frames = render_video(clip_for_prompt(two, 0, num_frames=2))
    single = VideoPrompt(video_prompt_text(two.objects[:1]), two.objects[:1])
    one_only = render_video(clip_for_prompt(single, 0, num_frames=2))
    assert len(two.objects) == 2
    assert reward(torch.from_numpy(one_only).permute(0, 3, 1, 2) / 255.0, two.text) == [0.5, 0.5]
    assert reward(torch.from_numpy(frames).permute(0, 3, 1, 2) / 255.0, two.text) == [1.0, 1.0]


def test_parse_video_prompt():
    for prompt in make_video_prompt_set(40):
        parsed = parse_video_prompt(prompt.text)
        assert parsed.objects == prompt.objects
    assert parse_video_prompt("a red circle moving up and to the left, an orange square moving down").objects[1].color \
        == "orange"
    for bad in ("a red circle", "a red blob moving right", "a red circle moving right and", "two circles", ""):
        with pytest.raises(ValueError, match="video format|prompt"):
            parse_video_prompt(bad)


def test_wrong_reward_output_and_bad_input(pipe):
    with pytest.raises(ValueError, match="returned 3 scores for a block of 2 frames"):
        pipe(PROMPTS[0], SDVGConfig(reward=lambda frames, prompt: [1.0, 1.0, 1.0]), generator=gen())
    with pytest.raises(ValueError, match="one number per frame"):
        pipe(PROMPTS[0], SDVGConfig(reward=lambda frames, prompt: "good"), generator=gen())
    with pytest.raises(ValueError, match="NaN"):
        pipe(PROMPTS[0], SDVGConfig(reward=lambda frames, prompt: [float("nan")] * 2), generator=gen())
    with pytest.raises(ValueError, match="SDVGConfig.tau must be a number or \\+-inf, got NaN"):
        SDVGConfig(tau=float("nan"))
    with pytest.raises(ValueError, match="SDVGConfig.tau must be a number"):
        SDVGConfig(tau="high")
    for blocks in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="num_blocks must be a positive integer"):
            pipe(PROMPTS[0], num_blocks=blocks)
    with pytest.raises(ValueError, match="exceeds the model's 4 blocks"):
        pipe(PROMPTS[0], num_blocks=5)
    with pytest.raises(ValueError, match="method='eagle' is not a method of ARVideoPipeline"):
        pipe(PROMPTS[0], "eagle")
    with pytest.raises(ValueError, match="SDVGConfig.reward must be one of"):
        SDVGConfig(reward="vision")
    with pytest.raises(ValueError, match="SDVGConfig.aggregate"):
        SDVGConfig(aggregate="max")
    with pytest.raises(ValueError, match="output_type"):
        pipe(PROMPTS[0], output_type="mp4")
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        pipe("a red circle moving sideways quickly")
    with pytest.raises(ValueError, match="empty list"):
        pipe([])
    with pytest.raises(ValueError, match="denoising_timesteps"):
        pipe(PROMPTS[0], denoising_timesteps=[250, 500])
    with pytest.raises(ValueError, match="num_inference_steps"):
        pipe(PROMPTS[0], num_inference_steps=0)
    with pytest.raises(ValueError, match="sampler"):
        pipe(PROMPTS[0], sampler="ddpm")
    with pytest.raises(ValueError, match="generator is a list of 2 generators, but the call makes 1 videos"):
        pipe(PROMPTS[0], generator=[gen(), gen()])
    with pytest.raises(ValueError, match="shapes world's video format"):
        pipe("a red circle", SDVGConfig(tau=0.5, reward="shapes"), generator=gen())
    with pytest.raises(ValueError, match="needs local weights"):
        resolve_reward("imagereward")
    with pytest.raises(ValueError, match="pretrained"):
        resolve_reward("clip")
    no_drafter = ARVideoPipeline(pipe.transformer, pipe.vae, None, pipe.text_tokenizer)
    with pytest.raises(ValueError, match="needs a drafter"):
        no_drafter(PROMPTS[0], "sdvg")
    with pytest.raises(ValueError, match="frames_per_block"):
        ARVideoPipeline(pipe.transformer, pipe.vae,
                        BlockCausalVideoTransformer(num_layers=1, dim=16, num_heads=4, num_frames=8,
                                                    frames_per_block=4, text_length=20), pipe.text_tokenizer)


def test_sampler_guidance_steps_and_batching(pipe):
    base = pipe(PROMPTS[0], "none", generator=gen(), output_type="latent", num_videos_per_prompt=2)
    assert base.latents.shape == (2, 8, 16, 8, 8)
    assert not torch.allclose(base.latents[0], base.latents[1])  # different noise per video
    renoise = pipe(PROMPTS[0], "none", sampler="renoise", generator=gen(), output_type="latent")
    two_steps = pipe(PROMPTS[0], "none", num_inference_steps=2, generator=gen(), output_type="latent")
    assert two_steps.stats.target_calls == 1 + 2 * 4
    guided = pipe(PROMPTS[0], SDVGConfig(tau=math.inf), guidance_scale=3.0, generator=gen(), output_type="latent")
    guided_none = pipe(PROMPTS[0], "none", guidance_scale=3.0, generator=gen(), output_type="latent")
    assert torch.equal(guided.latents, guided_none.latents)
    for other in (renoise, guided):
        assert not torch.allclose(other.latents, base.latents[:1])
    short = pipe(PROMPTS[0], SDVGConfig(reward=lambda f, p: [1.0] * f.shape[0]), num_blocks=2, generator=gen(),
                 output_type="np")
    assert short.frames.shape == (1, 4, 32, 32, 3) and short.stats.source == [["target", "draft"]]


def test_draft_guidance_scale_applies_to_the_drafter_only(pipe):
    """``draft_guidance_scale`` changes the drafter's blocks and nothing of the target's; None means "the same"."""
    guided_draft = pipe(PROMPTS[0], "draft", guidance_scale=3.0, generator=gen(), output_type="latent")
    split = pipe(PROMPTS[0], DraftConfig(draft_guidance_scale=3.0), guidance_scale=1.0, generator=gen(),
                 output_type="latent")
    assert torch.equal(split.latents, guided_draft.latents)
    plain_draft = pipe(PROMPTS[0], "draft", generator=gen(), output_type="latent")
    assert not torch.allclose(plain_draft.latents, guided_draft.latents)
    target = pipe(PROMPTS[0], "none", guidance_scale=3.0, generator=gen(), output_type="latent")
    target_split = pipe(PROMPTS[0], SDVGConfig(tau=math.inf, draft_guidance_scale=1.0), guidance_scale=3.0,
                        generator=gen(), output_type="latent")
    assert torch.equal(target.latents, target_split.latents)
    # SDVG accepting every block (tau = -inf, no forced first block) is the drafter at its own guidance
    all_drafts = pipe(PROMPTS[0], SDVGConfig(tau=-math.inf, force_reject_first=False, draft_guidance_scale=3.0),
                      guidance_scale=1.0, generator=gen(), output_type="latent")
    assert torch.equal(all_drafts.latents, guided_draft.latents)
    for bad in (-1.0, float("nan"), "3", True):
        for config in (SDVGConfig, DraftConfig):
            with pytest.raises(ValueError, match=f"{config.__name__}.draft_guidance_scale must be a number"):
                config(draft_guidance_scale=bad)


def test_draft_num_inference_steps_applies_to_the_drafter_only(pipe):
    """A few-step drafter (a reflow drafter's schedule): the drafter's blocks follow its own steps from the
    block's shared start noise, the target's are unchanged, and tau = -inf is still draft-only exactly."""
    one_step = pipe(PROMPTS[0], DraftConfig(draft_num_inference_steps=1), generator=gen(), output_type="latent")
    four = pipe(PROMPTS[0], "draft", generator=gen(), output_type="latent")
    assert one_step.stats.draft_calls == 1 + 1 * 4 and four.stats.draft_calls == 1 + 4 * 4
    assert not torch.allclose(one_step.latents, four.latents)
    # block 0 by hand: one Euler step from the block's first noise draw, x0 = x1 - v
    g = gen()
    noise = torch.randn((4, 1, 2, 16, 8, 8), generator=g).double()
    with torch.no_grad():
        cache = pipe.drafter.new_cache(1)
        pipe.drafter.encode_prompt(cache, pipe.encode_prompt([PROMPTS[0]]))
        v = pipe.drafter.predict_velocity(noise[0], 1000.0, cache, 0)
    assert torch.allclose(one_step.latents[:, :2], noise[0] - v, atol=1e-12)
    target = pipe(PROMPTS[0], "none", generator=gen(), output_type="latent")
    assert torch.equal(pipe(PROMPTS[0], SDVGConfig(tau=math.inf, draft_num_inference_steps=2), generator=gen(),
                            output_type="latent").latents, target.latents)
    all_drafts = pipe(PROMPTS[0], SDVGConfig(tau=-math.inf, force_reject_first=False, draft_num_inference_steps=1),
                      generator=gen(), output_type="latent")
    assert torch.equal(all_drafts.latents, one_step.latents)
    routed = pipe(PROMPTS[0], SDVGConfig(draft_num_inference_steps=2, reward=lambda f, p: [1.0] * f.shape[0]),
                  generator=gen(), output_type="latent")
    assert routed.stats.draft_calls == 1 + 2 * 3 and routed.stats.source == [["target"] + ["draft"] * 3]
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="DraftConfig.draft_num_inference_steps must be an integer"):
            DraftConfig(draft_num_inference_steps=bad)
    with pytest.raises(ValueError, match="draft_num_inference_steps=5 exceeds the target's 4 steps"):
        pipe(PROMPTS[0], DraftConfig(draft_num_inference_steps=5))


def test_refine_rejected_from_refines_the_rejected_draft(pipe):
    """refine_rejected_from=750: a rejected block is the target's last 3 steps from the draft noised to t=750
    along its path to the block's noise (by hand below); accepted blocks and the forced first block are
    unchanged; the first timestep (pure noise) is SDVG's full regeneration exactly."""
    from mmspec.models.video import denoise_block, noised_to

    scores = [[None, 0.0, 1.0, 0.0]]  # block 1 and 3 rejected, block 2 accepted
    full = pipe(PROMPTS[0], SDVGConfig(tau=0.5, reward=BlockReward(scores)), generator=gen(), output_type="latent")
    refined = pipe(PROMPTS[0], SDVGConfig(tau=0.5, reward=BlockReward(scores), refine_rejected_from=750),
                   generator=gen(), output_type="latent")
    assert refined.stats.source == full.stats.source == [["target", "target", "draft", "target"]]
    assert torch.equal(refined.latents[:, :2], full.latents[:, :2])  # never drafted: from noise
    assert not torch.allclose(refined.latents[:, 2:4], full.latents[:, 2:4])
    assert refined.stats.target_calls == full.stats.target_calls - 2  # one pass saved per refined block
    # block 1 by hand: draft it, noise it to 750 with its own start noise, then the target's steps 750/500/250
    g = gen()
    noise = [torch.randn((4, 1, 2, 16, 8, 8), generator=g).double() for _ in range(2)][1]
    ids = pipe.encode_prompt([PROMPTS[0]])
    with torch.no_grad():
        caches = {}
        for role, model in (("target", pipe.transformer), ("draft", pipe.drafter)):
            caches[role] = model.new_cache(1)
            model.encode_prompt(caches[role], ids)
            model.write_cache(refined.latents[:, :2], caches[role], 0)
        draft = denoise_block(pipe.drafter, caches["draft"], 2, noise, [1000, 750, 500, 250])
        start = noised_to(draft, noise[0], 750)
        expected = denoise_block(pipe.transformer, caches["target"], 2, noise[1:], [750, 500, 250], start=start)
    assert torch.allclose(refined.latents[:, 2:4], expected, atol=1e-10)
    assert torch.allclose(start, 0.25 * draft + 0.75 * noise[0], atol=1e-12)
    # the first timestep is pure noise: exactly SDVG's regeneration
    same = pipe(PROMPTS[0], SDVGConfig(tau=0.5, reward=BlockReward(scores), refine_rejected_from=1000),
                generator=gen(), output_type="latent")
    assert torch.equal(same.latents, full.latents) and same.stats.target_calls == full.stats.target_calls
    with pytest.raises(ValueError, match="refine_rejected_from must be None or one of the target's timesteps"):
        pipe(PROMPTS[0], SDVGConfig(tau=0.5, refine_rejected_from=600))  # in range, but not a timestep of the call
    for bad in ("750x", float("nan"), 0, 1001):
        with pytest.raises(ValueError, match="SDVGConfig.refine_rejected_from must be a number"):
            SDVGConfig(refine_rejected_from=bad)


def test_drafter_sampling_defaults_are_saved_with_the_pipeline(pipe, tmp_path):
    """``draft_num_inference_steps`` / ``draft_guidance_scale`` of the pipeline (model_index.json) apply when a
    call does not give them; a call's own values win."""
    configured = ARVideoPipeline(pipe.transformer, pipe.vae, pipe.drafter, pipe.text_tokenizer,
                                 draft_num_inference_steps=1, draft_guidance_scale=1.0)
    configured.set_progress_bar_config(disable=True)
    configured.save_pretrained(tmp_path / "reflow")
    index = json.loads((tmp_path / "reflow" / "model_index.json").read_text())
    assert index["draft_num_inference_steps"] == 1 and index["draft_guidance_scale"] == 1.0
    loaded = ARVideoPipeline.from_pretrained(tmp_path / "reflow", torch_dtype=torch.float64)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.config.draft_num_inference_steps == 1
    explicit = pipe(PROMPTS[0], DraftConfig(draft_num_inference_steps=1, draft_guidance_scale=1.0), guidance_scale=3.0,
                    generator=gen(), output_type="latent")
    by_default = loaded(PROMPTS[0], "draft", guidance_scale=3.0, generator=gen(), output_type="latent")
    assert_same_across_instances(by_default.latents, explicit.latents)  # another instance: see ACROSS_INSTANCES
    assert by_default.stats.draft_calls == 1 + 4
    overridden = loaded(PROMPTS[0], DraftConfig(draft_num_inference_steps=4, draft_guidance_scale=3.0), guidance_scale=3.0,
                        generator=gen(), output_type="latent")
    assert_same_across_instances(overridden.latents, pipe(PROMPTS[0], "draft", guidance_scale=3.0, generator=gen(),
                                                          output_type="latent").latents)
    assert pipe.config.draft_num_inference_steps is None  # a pipeline without settings drafts as the target
    for bad, match in (({"draft_num_inference_steps": 0}, "draft_num_inference_steps must be an integer in \\[1, 1000\\]"),
                       ({"draft_guidance_scale": float("nan")}, "draft_guidance_scale must be a number")):
        with pytest.raises(ValueError, match=match):
            ARVideoPipeline(pipe.transformer, pipe.vae, pipe.drafter, pipe.text_tokenizer, **bad)


def test_save_load_and_export(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "pipe")
    index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
    assert index["_class_name"] == "ARVideoPipeline" and index["drafter"][1] == "BlockCausalVideoTransformer"
    again = ARVideoPipeline.from_pretrained(tmp_path / "pipe", torch_dtype=torch.float64)
    again.set_progress_bar_config(disable=True)
    reward = ShapesFrameReward()
    a = pipe(PROMPTS, SDVGConfig(tau=0.5, reward=reward), generator=gen(), output_type="pt")
    b = again(PROMPTS, SDVGConfig(tau=0.5, reward=reward), generator=gen(), output_type="pt")
    assert_same_across_instances(b.latents, a.latents)
    assert a.stats.source == b.stats.source
    lone = ARVideoPipeline.from_pretrained(tmp_path / "pipe", drafter=None)
    assert lone.drafter is None
    with pytest.raises(ValueError, match="unexpected keyword"):
        ARVideoPipeline.from_pretrained(tmp_path / "pipe", eagle_head=None)
    with pytest.raises(FileNotFoundError):
        ARVideoPipeline.from_pretrained(tmp_path / "nothing")
    out = pipe(PROMPTS[0], "none", generator=gen())
    assert len(out.frames) == 1 and len(out.frames[0]) == 8 and isinstance(out.frames[0][0], PIL.Image.Image)
    gif = out.save(tmp_path / "video.gif", fps=4, scale=2)
    with PIL.Image.open(gif) as image:
        assert image.n_frames == 8 and image.size == (64, 64)
    export_video(np.zeros((3, 32, 32, 3), dtype=np.uint8), tmp_path / "zeros.gif")
    with pytest.raises(ValueError, match=r"\.gif or \.mp4"):
        out.save(tmp_path / "video.avi")
    if importlib.util.find_spec("imageio") is None and importlib.util.find_spec("cv2") is None:
        with pytest.raises(ImportError, match="imageio"):
            out.save(tmp_path / "video.mp4")


@pytest.mark.skipif(importlib.util.find_spec("open_clip") is None, reason="open_clip is an extra")
def test_clip_reward_from_local_random_weights(pipe, tmp_path):
    from mmspec.evaluation.clip_score import CLIPScorer, register_clip_config

    name = "mmspec-test-video-clip"
    register_clip_config(name, {"embed_dim": 32, "vision_cfg": {"image_size": 32, "layers": 1, "width": 32,
                                                                "head_width": 16, "patch_size": 8},
                                "text_cfg": {"context_length": 24, "vocab_size": 49408, "width": 32, "heads": 2,
                                             "layers": 1}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        random_model = CLIPScorer(name, None)
    torch.save(random_model.model.state_dict(), tmp_path / "clip.pt")
    kwargs = {"model": name, "pretrained": str(tmp_path / "clip.pt"), "image_size": 32}
    out = pipe(PROMPTS, SDVGConfig(tau=-1.0, reward="clip", reward_kwargs=kwargs), generator=gen(), output_type="pt")
    scores = out.stats.frame_rewards[:, 2:]
    assert not torch.isnan(scores).any() and ((scores >= 0) & (scores <= 100)).all()
    assert out.stats.accepted[:, 1:].all()  # CLIP scores are >= 0 > tau
    # the scores are the scorer's on the drafted frames: recompute block 1 of video 0
    scorer = CLIPScorer(name, tmp_path / "clip.pt")
    reward = ScorerFrameReward(scorer, "clip", 32)
    assert reward(out.frames[0, 2:4], PROMPTS[0]) == pytest.approx(out.stats.frame_rewards[0, 2:4].tolist(), abs=1e-4)
    assert pipe.get_reward("clip", kwargs) is pipe.get_reward("clip", kwargs)  # built once
    # built inside the call (inference mode) but kept: its weights are ordinary tensors
    assert not any(p.is_inference() for p in pipe.get_reward("clip", kwargs).scorer.model.parameters())


@pytest.mark.skipif(importlib.util.find_spec("ImageReward") is None, reason="image-reward is an extra")
def test_imagereward_from_local_random_weights(pipe, tmp_path):
    from mmspec.evaluation.imagereward import build_imagereward

    words = ["a", "red", "circle", "moving", "right", "blue", "square", "up", "and", "green", "diamond", "down",
             "to", "the", "left"]
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words))
    med = {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
           "hidden_dropout_prob": 0.1, "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 64,
           "layer_norm_eps": 1e-12, "max_position_embeddings": 40, "model_type": "bert", "num_attention_heads": 2,
           "num_hidden_layers": 1, "pad_token_id": 0, "type_vocab_size": 2, "vocab_size": 32, "encoder_width": 32,
           "add_cross_attention": True}
    (tmp_path / "med.json").write_text(json.dumps(med))
    vision = {"embed_dim": 32, "depth": 1, "num_heads": 2, "patch_size": 32}
    torch.manual_seed(0)
    model = build_imagereward(tmp_path / "med.json", tmp_path / "tok", vision=vision)
    torch.save(model.state_dict(), tmp_path / "ir.pt")
    kwargs = {"weights": str(tmp_path / "ir.pt"), "med_config": str(tmp_path / "med.json"),
              "tokenizer": str(tmp_path / "tok"), "vision": vision}
    out = pipe(PROMPTS[0], SDVGConfig(tau=-math.inf, reward="imagereward", reward_kwargs=kwargs), generator=gen())
    assert out.stats.reward_calls == 0  # tau = -inf needs no scores
    out = pipe(PROMPTS[0], SDVGConfig(tau=-100.0, reward="imagereward", reward_kwargs=kwargs), generator=gen())
    assert out.stats.reward_calls == 3 and not torch.isnan(out.stats.block_scores[0, 1:]).any()


def test_benchmark_pass_rate_of_own_blocks_skips_the_first_and_takes_the_worst_frame():
    """``own_block_pass_rate``: the share of blocks after the first whose worst frame reaches tau."""
    from mmspec.evaluation.bench_video import own_block_pass_rate

    def brightness(frames, prompt):  # one score per frame: its mean pixel value in [0, 1]
        return [float(frame.mean()) / 255.0 for frame in frames]

    levels = [[0, 0, 200, 200, 200, 50], [0, 0, 120, 200, 255, 255]]  # per frame; blocks of two frames
    videos = np.stack([np.stack([np.full((4, 4, 3), v, np.uint8) for v in video]) for video in levels])
    prompts = [make_video_prompt_set(1)[0]] * 2
    # blocks after the first: (200, 200) (200, 50) | (120, 200) (255, 255); the first blocks (0, 0) never count
    assert own_block_pass_rate(brightness, 0.5, videos, prompts, 2) == 0.5
    assert own_block_pass_rate(brightness, 0.4, videos, prompts, 2) == 0.75
    assert own_block_pass_rate(brightness, 0.1, videos, prompts, 2) == 1.0
    # the block mean: (200, 50) -> 125 passes 0.45 where its worst frame (50) does not
    assert own_block_pass_rate(brightness, 0.45, videos, prompts, 2, "mean") == 1.0
    assert own_block_pass_rate(brightness, 0.45, videos, prompts, 2) == 0.75
    from mmspec.evaluation.bench_video import SweepItem, parse_sweep

    assert parse_sweep(["match:0.4:mean", "fraction:1", "match:0.1:refine=750", "match:0.3:mean:refine=500"]) == [
        SweepItem("match", 0.4, "mean"), SweepItem("fraction", 1.0, "min"), SweepItem("match", 0.1, "min", 750.0),
        SweepItem("match", 0.3, "mean", 500.0)]
    assert SweepItem("match", 0.3, "mean", 750.0).case_name == "sdvg match tau=0.3 mean refine=750 (reference)"
    config = SweepItem("match", 0.3, "mean", 750.0).config(brightness, draft_steps=1)
    assert (config.tau, config.reward, config.aggregate, config.refine_rejected_from) == (0.3, brightness, "mean", 750.0)
    assert config.draft_num_inference_steps == 1 and config.draft_guidance_scale is None
    for bad in ("match:0.4:max", "match", "clip:0.3", "match:nan", "match:0.1:refine=x", "match:0.1:refine=nan",
                "match:0.1:mean:refine=750:min"):
        with pytest.raises(SystemExit):
            parse_sweep([bad])


def test_benchmark_goal_sentence_names_the_closest_case():
    from mmspec.evaluation.bench_video import best_tau

    def results(speedups: dict, scores: dict) -> dict:
        return {"quality": {n: {"frame_score": q} for n, q in scores.items()},
                "speed": {n: {"speedup": v} for n, v in speedups.items()}}

    scores = {"none": 0.5, "draft": 0.25, "sdvg a": 0.495, "sdvg b": 0.45}
    missed = results({"none": 1.0, "draft": 10.0, "sdvg a": 1.4982, "sdvg b": 1.8}, scores)
    name, sentence = best_tau(missed)
    assert name is None and "Goal not met" in sentence and "sdvg a, 1.498x at 99.0%" in sentence  # b is too lossy
    met = results({"none": 1.0, "draft": 10.0, "sdvg a": 1.52, "sdvg b": 1.8}, scores)
    assert best_tau(met)[0] == "sdvg a" and "Goal met" in best_tau(met)[1]
    # the lower of the two estimates counts: a ratio of medians over the line with a median paired ratio below
    met["speed"]["sdvg a"]["paired_speedup_median"] = 1.49
    name, sentence = best_tau(met)
    assert name is None and "sdvg a, 1.490x" in sentence
    met["speed"]["sdvg a"]["paired_speedup_median"] = 1.55
    assert best_tau(met)[0] == "sdvg a" and "1.52x faster" in best_tau(met)[1]


@pytest.mark.slow
def test_benchmark_script_writes_its_table(pipe, tmp_path):
    from mmspec.evaluation import bench_video

    pipe.save_pretrained(tmp_path / "pipe")
    out = tmp_path / "bench" / "video.md"
    assert bench_video.main(["--pipeline", str(tmp_path / "pipe"), "--sweep", "match:0.5", "match:0.5:mean",
                             "match:0.5:refine=750",
                             "--draft-steps", "1", "--quality-prompts", "2", "--speed-prompts", "1", "--repeats", "1",
                             "--threads", "1", "--out", str(out)]) == 0
    table = out.read_text()
    assert "| sdvg (reference) | match | 0.5 | from noise |" in table and "| none | - | - | - | 1.00x |" in table
    assert "| sdvg (reference) | match mean | 0.5 | from noise |" in table and "Command: `" in table
    assert "| sdvg (reference) | match | 0.5 | refined from 750 |" in table
    assert "4 denoising steps per block (reference rows' drafter: 1 steps, guidance 3)" in table
    # the stored settings' case: this folder stores none, so a plain method="sdvg" runs SDVGConfig's defaults
    assert "| sdvg (stored settings) | fraction | 0 | from noise |" in table and "**Stored settings**" in table
    assert "| none | - | - | - | 1.00x | 1.00x (1.00-1.00) |" in table  # one pass: the paired ratio is the ratio
    data = json.loads(out.with_suffix(".json").read_text())
    assert set(data["quality"]) == {"none", "draft", "sdvg", "sdvg match tau=0.5 (reference)",
                                    "sdvg match tau=0.5 mean (reference)", "sdvg match tau=0.5 refine=750 (reference)"}
    assert data["stored_settings"] == SDVGConfig().to_dict()
    refined = data["quality"]["sdvg match tau=0.5 refine=750 (reference)"]
    redrawn = data["quality"]["sdvg match tau=0.5 (reference)"]
    assert refined["acceptance"] == redrawn["acceptance"] == 0.0  # the untrained drafter's blocks all fail...
    assert refined["target_calls"] == redrawn["target_calls"] - 3  # ...and each of 3 refinements saves a pass
    assert redrawn["draft_calls"] == 1 + 1 * 3  # the reference rows' drafter: one step per drafted block
    assert data["quality"]["none"]["target_calls"] == 1 + 4 * 4 and data["quality"]["draft"]["target_calls"] == 0
    assert data["quality"]["draft"]["draft_calls"] == 1 + 4 * 4  # method="draft": the stored (default) 4 steps
    sdvg = data["quality"]["sdvg match tau=0.5 (reference)"]
    assert 0.0 <= sdvg["target_blocks_pass"] <= 1.0 and 0.0 <= sdvg["draft_blocks_pass"] <= 1.0
    assert "target_blocks_pass" not in data["quality"]["none"]
    assert out.with_suffix(".png").stat().st_size > 0


def _zoo_built() -> bool:
    from mmspec.pipelines.hub import zoo_dir

    return (zoo_dir() / "shapes-video" / "model_index.json").is_file()


@pytest.mark.skipif(not _zoo_built(), reason="mmspec/shapes-video is not built yet (see docs/pipeline_video.md)")
def test_zoo_entry_loads_offline_and_routes():
    from mmspec.pipelines.hub import zoo_dir

    folder = zoo_dir() / "shapes-video"
    assert sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) < 15 * 2**20
    report = json.loads((folder / "report.json").read_text())
    assert 0.0 <= report["target"]["frame_score"] <= 1.0
    pipe = ARVideoPipeline.from_pretrained("mmspec/shapes-video")
    pipe.set_progress_bar_config(disable=True)
    assert pipe.transformer.dtype == torch.float32 and pipe.drafter is not None  # fp16 on disk, fp32 compute
    layers = pipe.transformer.config.num_layers, pipe.drafter.config.num_layers
    assert layers[0] > layers[1]  # the target costs more per block than the drafter
    prompt = make_video_prompt_set(1)[0].text
    base = pipe(prompt, "none", num_blocks=3, generator=gen(), output_type="latent")
    same = pipe(prompt, pipe.method_config("sdvg").replace(tau=math.inf), num_blocks=3, generator=gen(),
                output_type="latent")
    assert torch.equal(base.latents, same.latents)
    spec = pipe(prompt, pipe.method_config("sdvg").replace(tau=0.5), num_blocks=3, generator=gen(), output_type="np")
    assert spec.frames.shape == (1, 6, 32, 32, 3) and spec.stats.reward_calls == 2
    # the reflow drafter drafts in one unguided step by the folder's defaults: 1 prompt pass, then per drafted
    # block one step (which also writes the previous block into its cache)
    assert (pipe.config.draft_num_inference_steps, pipe.config.draft_guidance_scale) == (1, 1.0)
    assert spec.stats.draft_calls == 1 + 2


@pytest.mark.skipif(not _zoo_built(), reason="mmspec/shapes-video is not built yet (see docs/pipeline_video.md)")
def test_zoo_report_matches_a_fresh_measurement():
    """report.json's target and drafter scores are what the bundled models produce: the first prompts'
    videos (seed i for prompt i, as report_video makes them) are regenerated and scored again."""
    from mmspec.pipelines.hub import zoo_dir

    report = json.loads((zoo_dir() / "shapes-video" / "report.json").read_text())
    pipe = ARVideoPipeline.from_pretrained("mmspec/shapes-video")
    pipe.set_progress_bar_config(disable=True)
    prompts = make_video_prompt_set(report["prompts"])[:4]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the report was made (--threads 1)
    try:
        _check_report_rows(pipe, report, prompts)
    finally:
        torch.set_num_threads(threads)


def _check_report_rows(pipe, report: dict, prompts: list) -> None:
    draft = pipe.method_config("draft")
    if report.get("draft_guidance_scale") is not None:
        draft = draft.replace(draft_guidance_scale=report["draft_guidance_scale"])
    for name, method in (("target", "none"), ("drafter", draft)):
        stored = report[name]["per_prompt_frame_score"]
        assert len(stored) == report["prompts"] and abs(sum(stored) / len(stored) - report[name]["frame_score"]) < 1e-5
        for i, prompt in enumerate(prompts):
            out = pipe(prompt.text, method, guidance_scale=report.get("guidance_scale", 1.0),
                       generator=torch.Generator().manual_seed(i), output_type="np")
            frames = (np.clip(out.frames[0], 0, 1) * 255 + 0.5).astype(np.uint8)
            assert float(np.mean(score_video(frames, prompt).frame_scores)) == pytest.approx(stored[i], abs=1e-6)


@pytest.mark.skipif(not _zoo_built(), reason="mmspec/shapes-video is not built yet (see docs/pipeline_video.md)")
def test_context_report_separates_own_errors_from_the_context(tmp_path):
    """``report_video context`` on the zoo: with the real clip as context both models continue it far
    better than on their own rollouts (the diagnosis behind the exposure-bias training options)."""
    from mmspec.models.recipes.report_video import context_report
    from mmspec.pipelines.hub import resolve_pretrained

    out = tmp_path / "context.json"
    result = context_report(Path(resolve_pretrained("mmspec/shapes-video")), 3, 1, out=out)
    scores = result["frame_score_after_first_block"]
    assert json.loads(out.read_text())["frame_score_after_first_block"] == scores
    assert set(scores) == {f"{role}: {way}" for role in ("target", "drafter")
                           for way in ("own rollout", "real first block", "real context")} | {"sdvg: real first block"}
    assert scores["target: real context"] >= 0.9
    for role in ("target", "drafter"):
        assert scores[f"{role}: real context"] > scores[f"{role}: own rollout"] + 0.2
    assert 0.0 <= result["sdvg_acceptance_real_first_block"] <= 1.0
