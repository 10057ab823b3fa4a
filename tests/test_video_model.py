"""The block-causal video diffusion model (models/video.py) and its training recipe: teacher-forced
training equals block-by-block inference against the KV cache, cache writes and rollback, row subsets,
the samplers, save/load, bad input, and a tiny resumable recipe run."""

from __future__ import annotations

import json

import pytest
import torch

from mmspec.models.recipes.video_loss import flow_matching_loss, predicted_context, rollout_context
from mmspec.models.video import (
    BlockCausalVideoTransformer,
    apply_rope,
    check_timesteps,
    denoise_block,
    rope_angles,
    sample_with_noise,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny(layers: int = 2, dim: int = 32, seed: int = 0, num_frames: int = 8, text_length: int = 6,
         dtype=torch.float64) -> BlockCausalVideoTransformer:
    """A tiny random model whose zero-initialised modulations/heads are randomised (so every input matters)."""
    torch.manual_seed(seed)
    model = BlockCausalVideoTransformer(num_layers=layers, dim=dim, num_heads=4, num_frames=num_frames,
                                        text_length=text_length).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


IDS = torch.tensor([[-1, -1, 3, 4, 5, 6], [-1, -1, -1, -1, -1, -1]])  # second row: the null prompt


def latents(batch: int = 2, frames: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, frames, 16, 8, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_teacher_forced_training_equals_blockwise_inference():
    model = tiny()
    clean, noisy = latents(seed=1), latents(seed=2)
    timesteps = torch.tensor([[1000.0, 750, 500, 250], [300, 200, 100, 900]])
    with torch.no_grad():
        reference = model.forward_train(clean, noisy, timesteps, IDS)  # [B, F, C, h, w]
        cache = model.new_cache(2)
        model.encode_prompt(cache, IDS)
        blocks = []
        for i in range(4):
            rows = [model.predict_velocity(noisy[b:b + 1, 2 * i:2 * i + 2], timesteps[b, i], cache, 2 * i,
                                           rows=torch.tensor([b])) for b in range(2)]
            blocks.append(torch.cat(rows))
            model.write_cache(clean[:, 2 * i:2 * i + 2], cache, 2 * i)
    assert torch.allclose(torch.cat(blocks, 1), reference, atol=1e-10)
    # a different context changes the prediction (the cache is really read)
    with torch.no_grad():
        other = model.new_cache(2)
        model.encode_prompt(other, IDS)
        model.write_cache(clean[:, :2] + 1.0, other, 0)
        v = model.predict_velocity(noisy[:, 2:4], 500.0, other, 2)
    assert not torch.allclose(v, blocks[1], atol=1e-3)


def test_cache_writes_multi_block_rollback_and_rows():
    model = tiny()
    clean = latents()
    with torch.no_grad():
        one = model.new_cache(2)
        model.encode_prompt(one, IDS)
        for f in range(0, 6, 2):
            model.write_cache(clean[:, f:f + 2], one, f)
        many = model.new_cache(2)
        model.encode_prompt(many, IDS)
        model.write_cache(clean[:, :6], many, 0)  # three blocks in one block-causal pass
    assert one.num_frames == many.num_frames == 6 and one.length == 6 + 6 * model.tokens_per_frame
    assert torch.allclose(one.kv.keys[:, :, :, :one.length], many.kv.keys[:, :, :, :many.length], atol=1e-12)
    assert torch.allclose(one.kv.values[:, :, :, :one.length], many.kv.values[:, :, :, :many.length], atol=1e-12)
    assert one.key_mask[0, :6].tolist() == (IDS[0] >= 0).tolist()
    assert one.key_mask[1, :6].tolist() == [False] * 5 + [True]  # null prompt in the last slot
    with torch.no_grad():
        full = model.predict_velocity(clean[:, 6:8], 250.0, one, 6)
        row = model.predict_velocity(clean[1:2, 6:8], 250.0, one, 6, rows=torch.tensor([1]))
    assert torch.allclose(full[1:2], row, atol=1e-12)
    # roll back to 2 frames (core crop_cache) and rewrite: identical to the first writes
    one.crop_frames(2)
    assert one.num_frames == 2
    with torch.no_grad():
        model.write_cache(clean[:, 2:6], one, 2)
    assert torch.allclose(one.kv.keys[:, :, :, :one.length], many.kv.keys[:, :, :, :many.length], atol=1e-12)
    with pytest.raises(ValueError, match="num_frames"):
        one.crop_frames(8)


def _cache_with_prompt(model: BlockCausalVideoTransformer, ids: torch.Tensor = IDS):
    cache = model.new_cache(ids.shape[0])
    model.encode_prompt(cache, ids)
    return cache


def test_pending_clean_frames_are_written_by_the_denoising_pass():
    """predict_velocity(pending_clean=...) == write_cache(...) then predict_velocity: same velocity, same cache."""
    model = tiny()
    clean, noisy = latents(seed=1), latents(seed=2)
    with torch.no_grad():
        for first, pending in ((0, 2), (2, 4)):  # one pending block after an empty cache; two after one block
            separate, fused = _cache_with_prompt(model), _cache_with_prompt(model)
            if first:
                model.write_cache(clean[:, :first], separate, 0)
                model.write_cache(clean[:, :first], fused, 0)
            end = first + pending
            model.write_cache(clean[:, first:end], separate, first)
            expected = model.predict_velocity(noisy[:, end:end + 2], torch.tensor([900.0, 300.0]), separate, end)
            v = model.predict_velocity(noisy[:, end:end + 2], torch.tensor([900.0, 300.0]), fused, end,
                                       pending_clean=clean[:, first:end])
            assert torch.allclose(v, expected, atol=1e-10)
            assert fused.num_frames == separate.num_frames == end and fused.length == separate.length
            assert torch.allclose(fused.kv.keys[:, :, :, :fused.length], separate.kv.keys[:, :, :, :separate.length],
                                  atol=1e-10)
            assert torch.allclose(fused.kv.values[:, :, :, :fused.length],
                                  separate.kv.values[:, :, :, :separate.length], atol=1e-10)
            assert torch.equal(fused.key_mask, separate.key_mask)
        # the pending frames are really read by the denoised block
        other = _cache_with_prompt(model)
        moved = model.predict_velocity(noisy[:, 2:4], 500.0, other, 2, pending_clean=clean[:, :2] + 1.0)
        plain = model.predict_velocity(noisy[:, 2:4], 500.0, _cache_with_prompt(model), 2,
                                       pending_clean=clean[:, :2])
    assert not torch.allclose(moved, plain, atol=1e-3)


def test_denoise_block_writes_pending_frames_in_its_first_pass_also_under_guidance():
    model = tiny()
    clean = latents(seed=1)
    ids = IDS[:1].repeat(2, 1)
    noise = torch.randn((2, 2, 2, 16, 8, 8), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    halves = torch.cat([ids, torch.full_like(ids, -1)])
    with torch.no_grad():
        for scale, rows_ids in ((1.0, ids), (3.0, halves)):
            separate, fused = _cache_with_prompt(model, rows_ids), _cache_with_prompt(model, rows_ids)
            written = clean[:, :2] if scale == 1.0 else torch.cat([clean[:, :2], clean[:, :2]])
            model.write_cache(written, separate, 0)
            expected = denoise_block(model, separate, 2, noise, [1000.0, 500.0], guidance_scale=scale)
            out = denoise_block(model, fused, 2, noise, [1000.0, 500.0], guidance_scale=scale,
                                pending_clean=clean[:, :2])
            assert torch.allclose(out, expected, atol=1e-10) and fused.num_frames == 2
            assert torch.allclose(fused.kv.keys[:, :, :, :fused.length], separate.kv.keys[:, :, :, :separate.length],
                                  atol=1e-10)


def test_pending_clean_bad_input():
    model = tiny()
    x = latents()
    cache = _cache_with_prompt(model)
    with pytest.raises(ValueError, match="cannot be combined with rows"):
        model.predict_velocity(x[:1, 2:4], 500.0, cache, 2, rows=torch.tensor([0]), pending_clean=x[:, :2])
    with pytest.raises(ValueError, match="whole blocks"):
        model.predict_velocity(x[:, 1:3], 500.0, cache, 1, pending_clean=x[:, :1])
    with pytest.raises(ValueError, match="2 are pending; the next block starts there, not at frame 4"):
        model.predict_velocity(x[:, 4:6], 500.0, cache, 4, pending_clean=x[:, :2])
    with pytest.raises(ValueError, match="pending_clean has 1 rows but the cache 2"):
        model.predict_velocity(x[:, 2:4], 500.0, cache, 2, pending_clean=x[:1, :2])
    assert cache.num_frames == 0  # nothing was written by the refused calls


def test_prompt_and_null_prompt_matter():
    model = tiny()
    noisy = latents(batch=1)
    outs = []
    with torch.no_grad():
        for ids in (IDS[:1], IDS[1:], torch.tensor([[-1, -1, 7, 8, 9, 10]])):
            cache = model.new_cache(1)
            model.encode_prompt(cache, ids)
            outs.append(model.predict_velocity(noisy[:, :2], 1000.0, cache, 0))
    assert not torch.allclose(outs[0], outs[1], atol=1e-4) and not torch.allclose(outs[0], outs[2], atol=1e-4)


class _Oracle:
    """predict_velocity of the exact flow for a point-mass data distribution x0* (v = (x_t - x0*) / t)."""

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target

    def predict_velocity(self, x, timestep, cache, frame_start, rows=None):
        t = float(timestep) / 1000.0
        return (x - self.target) / t


@pytest.mark.parametrize("sampler", ["euler", "renoise"])
def test_samplers_recover_a_point_mass(sampler):
    target = latents(batch=2, frames=2, seed=3)
    noise = torch.randn(4, *target.shape, dtype=torch.float64)
    out = denoise_block(_Oracle(target), None, 0, noise, [1000, 750, 500, 250], sampler)
    assert torch.allclose(out, target, atol=1e-10)
    with pytest.raises(ValueError, match="sampler"):
        denoise_block(_Oracle(target), None, 0, noise, [1000, 500], "ddim")


def test_rope_scores_depend_on_relative_offsets_only():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 32, generator=g, dtype=torch.float64), torch.randn(1, 1, 1, 32, generator=g,
                                                                                   dtype=torch.float64)

    def score(qpos, kpos):
        a = rope_angles(*(torch.tensor([p]) for p in qpos), 32).double()
        b = rope_angles(*(torch.tensor([p]) for p in kpos), 32).double()
        return float((apply_rope(q, a.cos(), a.sin()) * apply_rope(k, b.cos(), b.sin())).sum())

    assert score((3, 1, 2), (2, 0, 2)) == pytest.approx(score((9, 2, 0), (8, 1, 0)), abs=1e-6)  # same offsets (fp32 angles)
    assert score((3, 1, 2), (2, 0, 2)) != pytest.approx(score((3, 1, 2), (1, 0, 2)), abs=1e-3)  # other offset
    norm = apply_rope(q, *(lambda a: (a.cos(), a.sin()))(rope_angles(torch.tensor([5]), torch.tensor([3]),
                                                                    torch.tensor([1]), 32).double())).norm()
    assert float(norm) == pytest.approx(float(q.norm()))
    # without rope the model still trains and infers consistently
    model = BlockCausalVideoTransformer(num_layers=1, dim=32, num_heads=4, num_frames=4, text_length=6, rope=False)
    assert model._rope(0, 2) is None


def test_check_timesteps():
    assert check_timesteps((1000, 750, 500, 250)) == [1000.0, 750.0, 500.0, 250.0]
    for bad in ([], [1000, 1000], [500, 750], [1200], [0], [float("nan")]):
        with pytest.raises(ValueError, match="denoising_timesteps"):
            check_timesteps(bad)


def test_bad_input():
    model = tiny()
    cache = model.new_cache(2)
    model.encode_prompt(cache, IDS)
    x = latents()
    with pytest.raises(ValueError, match="latents must be"):
        model.predict_velocity(x[:, :2, :8], 500.0, cache, 0)
    with pytest.raises(ValueError, match="outside the model's 8 frames"):
        model.predict_velocity(x[:, :2], 500.0, cache, 8)
    with pytest.raises(ValueError, match="next block starts there"):
        model.predict_velocity(x[:, :2], 500.0, cache, 2)
    with pytest.raises(ValueError, match="rows"):
        model.predict_velocity(x[:1, :2], 500.0, cache, 0)
    with pytest.raises(ValueError, match="whole blocks"):
        model.write_cache(x[:, :1], cache, 0)
    with pytest.raises(ValueError, match="empty cache"):
        model.encode_prompt(cache, IDS)
    with pytest.raises(ValueError, match="prompt_ids must be"):
        model.encode_prompt(model.new_cache(2), IDS[:, :3])
    with pytest.raises(ValueError, match="batch_size"):
        model.new_cache(0)
    with pytest.raises(ValueError, match="multiple of frames_per_block"):
        BlockCausalVideoTransformer(num_frames=7, frames_per_block=2)
    with pytest.raises(ValueError, match="num_layers"):
        BlockCausalVideoTransformer(num_layers=0)


def test_save_load_roundtrip(tmp_path):
    model = tiny(dtype=torch.float32)
    model.save_pretrained(tmp_path / "m")
    again = BlockCausalVideoTransformer.from_pretrained(tmp_path / "m").eval()
    x = latents().float()
    outs = []
    for m in (model, again):
        with torch.no_grad():
            cache = m.new_cache(2)
            m.encode_prompt(cache, IDS)
            outs.append(m.predict_velocity(x[:, :2], 750.0, cache, 0))
    assert torch.equal(outs[0], outs[1])


def test_flow_matching_loss_trains():
    torch.manual_seed(0)
    model = BlockCausalVideoTransformer(num_layers=1, dim=32, num_heads=4, num_frames=4, text_length=6)
    # structured data (a constant latent per clip and channel) that a 1-layer model can learn quickly
    clean = torch.randn(2, 1, 16, 1, 1, generator=torch.Generator().manual_seed(5)).expand(2, 4, 16, 8, 8).contiguous()

    def held_out_loss() -> float:  # the same noise and timesteps before and after training
        with torch.no_grad():
            return flow_matching_loss(model, clean, IDS, generator=torch.Generator().manual_seed(123)).item()

    before = held_out_loss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        loss = flow_matching_loss(model, clean, IDS, generator=g)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert held_out_loss() < 0.7 * before


def test_predicted_context_is_the_models_one_shot_prediction_of_each_block():
    model = tiny()
    clean = latents(seed=1)
    g = torch.Generator().manual_seed(7)
    context = predicted_context(model, clean, IDS, [500.0], g)
    # by hand: the same noise, every block at t = 500, x0 = x_t - t v from one teacher-forced pass
    g = torch.Generator().manual_seed(7)
    torch.randint(0, 1, (2, 4), generator=g)  # the timestep draw (one choice)
    noisy = 0.5 * clean + 0.5 * torch.randn(clean.shape, generator=g).double()
    with torch.no_grad():
        v = model.forward_train(clean, noisy, torch.full((2, 4), 500.0, dtype=torch.float64), IDS)
    assert torch.allclose(context, noisy - 0.5 * v, atol=1e-12)
    assert not context.requires_grad and not torch.allclose(context, clean, atol=1e-3)


def test_rollout_context_samples_every_block_after_the_first_as_inference_does():
    model = tiny()
    clean = latents(seed=1)
    context = rollout_context(model, clean, IDS, [1000.0, 500.0], torch.Generator().manual_seed(4))
    assert torch.equal(context[:, :2], clean[:, :2]) and torch.equal(context[:, 6:], clean[:, 6:])
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        cache = model.new_cache(2)
        model.encode_prompt(cache, IDS)
        expected = clean[:, :2]
        for start in (2, 4):  # block 1 continues the real block 0, block 2 the model's own block 1
            model.write_cache(expected[:, -2:], cache, start - 2)
            noise = torch.randn((2, 2, 2, 16, 8, 8), generator=g).double()
            expected = torch.cat([expected, denoise_block(model, cache, start, noise, [1000.0, 500.0])], 1)
    assert torch.allclose(context[:, :6], expected, atol=1e-12)
    assert not torch.allclose(context[:, 2:6], clean[:, 2:6], atol=1e-3)


def test_guided_denoise_block_and_rollout_combine_the_cond_and_null_prompt_halves():
    model = tiny()
    clean = latents(seed=1)
    ids = IDS[:1].repeat(2, 1)
    noise = torch.randn((2, 2, 2, 16, 8, 8), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        both = model.new_cache(4)
        model.encode_prompt(both, torch.cat([ids, torch.full_like(ids, -1)]))
        model.write_cache(torch.cat([clean[:, :2], clean[:, :2]]), both, 0)
        guided = denoise_block(model, both, 2, noise, [1000.0, 500.0], guidance_scale=3.0)
        # by hand: one Euler step with v = v_null + 3 (v_cond - v_null), then the x0 prediction
        x = noise[0]
        for t, t_next in ((1.0, 0.5), (0.5, None)):
            cond, null = model.predict_velocity(torch.cat([x, x]), t * 1000, both, 2).chunk(2)
            v = null + 3.0 * (cond - null)
            x = x + (t_next - t) * v if t_next else x - t * v
    assert torch.allclose(guided, x, atol=1e-12)
    # a subset of the videos (the pipeline's rejected rows) reads its own cond and null rows
    with torch.no_grad():
        second = denoise_block(model, both, 2, noise[:, 1:], [1000.0, 500.0], rows=torch.tensor([1]),
                               guidance_scale=3.0)
    assert torch.allclose(second, guided[1:], atol=1e-12)
    plain = rollout_context(model, clean, ids, [1000.0, 500.0], torch.Generator().manual_seed(4))
    strong = rollout_context(model, clean, ids, [1000.0, 500.0], torch.Generator().manual_seed(4), guidance_scale=3.0)
    assert torch.equal(strong[:, :2], clean[:, :2]) and not torch.allclose(strong[:, 2:6], plain[:, 2:6], atol=1e-6)


def test_sample_with_noise_is_the_pipelines_target_only_video_and_its_start_noise():
    """The reflow data: the same latents as ``ARVideoPipeline(method="none")`` for the same generator, and the
    x_1 each block started from."""
    from mmspec.models.text import WordTokenizer
    from mmspec.models.tokenizers import load_zoo_tokenizer
    from mmspec.pipelines.ar_video import ARVideoPipeline
    from mmspec.world import vocabulary

    model = tiny(text_length=20)
    pipe = ARVideoPipeline(model, load_zoo_tokenizer("continuous"), None, WordTokenizer(vocabulary()))
    pipe.set_progress_bar_config(disable=True)
    prompts = ["a red circle moving right", "a blue square moving up"]
    ids = pipe.encode_prompt(prompts)
    for scale in (1.0, 3.0):
        video, start = sample_with_noise(model, ids, None, [1000.0, 500.0], torch.Generator().manual_seed(5), scale)
        expected = pipe(prompts, "none", num_inference_steps=2, guidance_scale=scale,
                        generator=torch.Generator().manual_seed(5), output_type="latent").latents
        assert torch.allclose(video, expected, atol=1e-12)
    g = torch.Generator().manual_seed(5)
    draws = [torch.randn((2, 2, 2, 16, 8, 8), generator=g).double() for _ in range(4)]  # per block: [steps, B, ...]
    assert torch.equal(start, torch.cat([d[0] for d in draws], 1))
    short, _ = sample_with_noise(model, ids, 4, [1000.0], torch.Generator().manual_seed(5))
    assert short.shape == (2, 4, 16, 8, 8)
    with pytest.raises(ValueError, match="num_frames must be a positive multiple of 2 up to 8"):
        sample_with_noise(model, ids, 3)


def test_flow_matching_loss_on_a_noise_coupling():
    """``noise=``: the paired noise replaces the fresh draw; at t = 1000 the loss is exactly the one-step error
    ``|v(noise) - (noise - clean)|^2``, what a one-step reflow drafter minimises."""
    model = tiny()
    clean, paired = latents(seed=1), latents(seed=2)
    loss = flow_matching_loss(model, clean, IDS, generator=torch.Generator().manual_seed(3), fixed_timesteps=[1000.0],
                              fixed_fraction=1.0, noise=paired)
    with torch.no_grad():
        v = model.forward_train(clean, paired, torch.full((2, 4), 1000.0, dtype=torch.float64), IDS)
    assert loss.item() == pytest.approx(torch.mean((v - (paired - clean)) ** 2).item(), rel=1e-6)  # fp32 loss
    fresh = flow_matching_loss(model, clean, IDS, generator=torch.Generator().manual_seed(3),
                               fixed_timesteps=[1000.0], fixed_fraction=1.0)
    assert fresh.item() != pytest.approx(loss.item(), rel=1e-6)
    with pytest.raises(ValueError, match="noise must have the clean latents' shape"):
        flow_matching_loss(model, clean, IDS, noise=paired[:, :4])


def test_self_context_replaces_the_context_but_not_the_target():
    model = tiny()
    clean = latents(seed=1)
    loss = lambda share, seed=3: flow_matching_loss(  # noqa: E731
        model, clean, IDS, generator=torch.Generator().manual_seed(seed), self_context=share).item()
    # the context changes the prediction, so the loss changes; a share of 0 is the plain loss
    assert loss(1.0) != pytest.approx(loss(0.0), rel=1e-6)
    assert loss(0.0) == flow_matching_loss(model, clean, IDS, generator=torch.Generator().manual_seed(3)).item()
    # a single block has no context: nothing to replace, the same loss
    one_block = clean[:, :2]
    assert flow_matching_loss(model, one_block, IDS, generator=torch.Generator().manual_seed(3),
                              self_context=1.0).item() == \
        flow_matching_loss(model, one_block, IDS, generator=torch.Generator().manual_seed(3)).item()
    assert loss(0.0) != flow_matching_loss(model, clean, IDS, generator=torch.Generator().manual_seed(3),
                                           rollout=1.0).item()
    for bad in ({"self_context": 1.5}, {"rollout": -0.1}, {"self_context": 0.6, "rollout": 0.6}):
        with pytest.raises(ValueError, match="self_context and rollout"):
            flow_matching_loss(model, clean, IDS, **bad)


def test_recipe_runs_saves_and_resumes(tmp_path):
    from mmspec.models.recipes import train_video

    args = ["--out", str(tmp_path / "model"), "--work", str(tmp_path / "work"), "--dim", "32", "--layers", "1",
            "--heads", "4", "--num-frames", "4", "--train-clips", "6", "--batch", "2", "--steps", "4",
            "--save-every", "2", "--threads", "1"]
    train_video.main(args)
    log = [json.loads(line) for line in (tmp_path / "work" / "log.jsonl").read_text().splitlines()]
    model = BlockCausalVideoTransformer.from_pretrained(tmp_path / "model")
    assert model.config.num_frames == 4 and model.config.num_layers == 1
    from safetensors.torch import load_file

    stored = load_file(tmp_path / "model" / "diffusion_pytorch_model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.float16}  # fp16 on disk
    assert (tmp_path / "model" / "text_vocab.json").is_file()
    data = torch.load(tmp_path / "work" / "data.pt")
    assert data["latents"].shape == (6, 4, 16, 8, 8) and len(data["captions"]) == 6
    assert all(" moving " in c for c in data["captions"])
    train_video.main(args[:-6] + ["--steps", "6", "--save-every", "2", "--threads", "1"])  # resumes at step 4
    assert torch.load(tmp_path / "work" / "checkpoint.pt")["step"] == 6
    assert len((tmp_path / "work" / "log.jsonl").read_text().splitlines()) >= len(log)


def test_recipe_second_stage_starts_from_init_and_adds_first_blocks(tmp_path):
    from mmspec.models.recipes import train_video

    small = ["--dim", "32", "--layers", "1", "--heads", "4", "--num-frames", "4", "--train-clips", "6", "--batch", "2",
             "--save-every", "2", "--threads", "1"]
    train_video.main(["--out", str(tmp_path / "a"), "--work", str(tmp_path / "wa"), "--steps", "2", *small])
    stage1 = BlockCausalVideoTransformer.from_pretrained(tmp_path / "a")
    copied = BlockCausalVideoTransformer(**{k: v for k, v in stage1.config.items() if not k.startswith("_")})
    train_video.init_from(copied, tmp_path / "a")
    assert all(torch.equal(p, q) for p, q in zip(stage1.state_dict().values(), copied.state_dict().values()))
    stage2_args = ["--init", str(tmp_path / "a"), "--first-block-batch", "3", "--first-block-clips", "5", *small]
    train_video.main(["--out", str(tmp_path / "c"), "--work", str(tmp_path / "wc"), "--steps", "2", *stage2_args])
    trained = BlockCausalVideoTransformer.from_pretrained(tmp_path / "c")
    assert not all(torch.equal(p, q) for p, q in zip(stage1.state_dict().values(), trained.state_dict().values()))
    first = torch.load(tmp_path / "wc" / "first_blocks.pt")
    assert first["latents"].shape == (5, 2, 16, 8, 8)  # one block of 2 frames per extra clip
    full = torch.load(tmp_path / "wc" / "data.pt")
    assert not any(torch.equal(f, d[:2]) for f in first["latents"] for d in full["latents"])  # fresh clips
    with pytest.raises(ValueError, match="another architecture"):
        train_video.main(["--out", str(tmp_path / "d"), "--work", str(tmp_path / "wd"), "--steps", "1",
                          *stage2_args[:-12], "--dim", "64", *small[2:]])
    with pytest.raises(FileNotFoundError, match="no trained model"):
        train_video.main(["--out", str(tmp_path / "e"), "--work", str(tmp_path / "we"), "--steps", "1",
                          "--init", str(tmp_path / "missing"), *small])
    with pytest.raises(SystemExit):
        train_video.main(["--out", str(tmp_path / "f"), "--first-block-batch", "-1", *small])
    # a third stage on the model's own predicted context (exposure bias): trains, and checks its options
    train_video.main(["--out", str(tmp_path / "g"), "--work", str(tmp_path / "wg"), "--steps", "2",
                      "--init", str(tmp_path / "a"), "--self-context", "1", "--context-timesteps", "250,750", *small])
    third = BlockCausalVideoTransformer.from_pretrained(tmp_path / "g")
    assert not all(torch.equal(p, q) for p, q in zip(stage1.state_dict().values(), third.state_dict().values()))
    train_video.main(["--out", str(tmp_path / "r"), "--work", str(tmp_path / "wr"), "--steps", "1",
                      "--init", str(tmp_path / "a"), "--rollout-context", "1", *small])
    for bad in (["--self-context", "1.5"], ["--context-timesteps", "0,500"], ["--context-timesteps", "x"],
                ["--self-context", "0.5", "--rollout-context", "0.6"]):
        with pytest.raises(SystemExit):
            train_video.main(["--out", str(tmp_path / "h"), "--work", str(tmp_path / "wh"), *bad, *small])


def test_recipe_reflow_drafter_trains_on_the_targets_videos_and_their_noise(tmp_path):
    from mmspec.models.recipes import train_video

    small = ["--dim", "32", "--heads", "4", "--num-frames", "4", "--train-clips", "5", "--batch", "2",
             "--save-every", "2", "--threads", "1"]
    train_video.main(["--out", str(tmp_path / "target"), "--work", str(tmp_path / "wt"), "--layers", "2", "--steps", "1",
                      *small])
    reflow = ["--reflow-from", str(tmp_path / "target"), "--reflow-clips", "3", "--reflow-guidance", "2",
              "--reflow-timesteps", "1000,500", "--fixed-fraction", "0.75", "--condition-dropout", "0"]
    train_video.main(["--out", str(tmp_path / "drafter"), "--work", str(tmp_path / "wd"), "--layers", "1",
                      "--steps", "2", *reflow, *small])
    data = torch.load(tmp_path / "wd" / "reflow.pt")
    words = torch.load(tmp_path / "wd" / "data.pt")["words"]
    assert data["latents"].shape == data["noise"].shape == (3, 4, 16, 8, 8) and torch.equal(data["words"], words[:3])
    # the target's own videos, from the recorded noise (sample_with_noise with the recipe's seed and guidance)
    target = BlockCausalVideoTransformer.from_pretrained(tmp_path / "target").float()
    video, noise = sample_with_noise(target, words[:3], None, [1000.0, 750.0, 500.0, 250.0],
                                     torch.Generator().manual_seed(0), 2.0)
    assert torch.allclose(data["latents"].float(), video, atol=2e-2) and torch.equal(data["noise"], noise.half())
    assert BlockCausalVideoTransformer.from_pretrained(tmp_path / "drafter").config.num_layers == 1
    for bad in (["--reflow-clips", "6"], ["--reflow-timesteps", "0"], ["--fixed-fraction", "1.5"]):
        with pytest.raises(SystemExit):
            train_video.main(["--out", str(tmp_path / "x"), "--work", str(tmp_path / "wx"), *reflow, *bad, *small])
    # a second run on the first run's target videos (--reflow-data): the same data, no sampling
    train_video.main(["--out", str(tmp_path / "again"), "--work", str(tmp_path / "wa"), "--layers", "1", "--steps", "1",
                      *reflow, "--reflow-data", str(tmp_path / "wd" / "reflow.pt"), *small])
    assert not (tmp_path / "wa" / "reflow.pt").exists()
    with pytest.raises(ValueError, match="holds no start noise"):
        train_video.main(["--out", str(tmp_path / "z"), "--work", str(tmp_path / "wz"), "--layers", "1", "--steps", "1",
                          *reflow, "--reflow-data", str(tmp_path / "wd" / "data.pt"), *small])
    with pytest.raises(FileNotFoundError, match="--reflow-from: no trained model"):
        train_video.main(["--out", str(tmp_path / "y"), "--work", str(tmp_path / "wy"), "--reflow-from",
                          str(tmp_path / "missing"), "--reflow-clips", "2", *small])


def test_init_layers_builds_a_layer_skip_drafter_from_a_deeper_model(tmp_path):
    from mmspec.models.recipes import train_video

    deep = BlockCausalVideoTransformer(num_layers=3, dim=32, num_heads=4, num_frames=4, frames_per_block=2,
                                       text_length=8)
    deep.save_pretrained(tmp_path / "deep")
    config = {k: v for k, v in deep.config.items() if not k.startswith("_")}
    shallow = BlockCausalVideoTransformer(**{**config, "num_layers": 2})
    train_video.init_from(shallow, tmp_path / "deep", [0, 2])
    assert torch.equal(shallow.blocks[1].qkv.weight, deep.blocks[2].qkv.weight)
    assert torch.equal(shallow.blocks[0].mlp[0].weight, deep.blocks[0].mlp[0].weight)
    assert torch.equal(shallow.head.weight, deep.head.weight) and torch.equal(shallow.word_embed.weight,
                                                                              deep.word_embed.weight)
    for bad in ([0], [0, 3], [-1, 1]):
        with pytest.raises(ValueError, match="--init-layers: need 2 block indices"):
            train_video.init_from(shallow, tmp_path / "deep", bad)
    with pytest.raises(ValueError, match="another architecture"):  # without layers the depth must match
        train_video.init_from(shallow, tmp_path / "deep")
    with pytest.raises(SystemExit):  # --init-layers without --init
        train_video.main(["--out", str(tmp_path / "x"), "--init-layers", "0,1"])


def test_recipe_stop_at_runs_a_schedule_in_pieces(tmp_path):
    from mmspec.models.recipes import train_video

    small = ["--dim", "32", "--layers", "1", "--heads", "4", "--num-frames", "4", "--train-clips", "6", "--batch", "2",
             "--save-every", "100", "--threads", "1", "--steps", "4"]
    train_video.main(["--out", str(tmp_path / "a"), "--work", str(tmp_path / "wa"), *small])
    train_video.main(["--out", str(tmp_path / "b"), "--work", str(tmp_path / "wb"), "--stop-at", "3", *small])
    assert torch.load(tmp_path / "wb" / "checkpoint.pt")["step"] == 3  # saved at the stop although not a save step
    train_video.main(["--out", str(tmp_path / "b"), "--work", str(tmp_path / "wb"), *small])  # the rest
    whole = BlockCausalVideoTransformer.from_pretrained(tmp_path / "a").state_dict()
    pieces = BlockCausalVideoTransformer.from_pretrained(tmp_path / "b").state_dict()
    assert all(torch.equal(whole[k], pieces[k]) for k in whole)  # same schedule, same result


def test_block_loss_report_per_block_with_and_without_prompt():
    from mmspec.models.recipes.report_video import block_losses

    torch.manual_seed(0)
    model = BlockCausalVideoTransformer(latent_channels=4, latent_size=4, patch_size=2, num_frames=4,
                                        frames_per_block=2, dim=32, num_layers=1, num_heads=4, text_vocab_size=10,
                                        text_length=3).eval()
    with torch.no_grad():  # adaLN-zero starts every block as the identity: give the layers something to do
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    latents = torch.randn(3, 4, 4, 4, 4)
    words = torch.tensor([[-1, 1, 2], [3, 4, 5], [-1, -1, 6]])
    out = block_losses(model, latents, words, 750.0)
    assert set(out) == {"prompt", "null prompt"} and all(len(v) == 2 and min(v) > 0 for v in out.values())
    assert out["prompt"] != out["null prompt"]  # the prompt reaches every block's prediction
    assert block_losses(model, latents, words, 750.0) == out  # fixed noise seed: reproducible


def test_block_loss_command_on_a_saved_model_without_its_own_vocabulary(tmp_path, capsys):
    """A pipeline folder's drafter has no text_vocab.json: the command falls back to train_video's vocabulary."""
    from mmspec.models.recipes import report_video
    from mmspec.world import vocabulary

    model = BlockCausalVideoTransformer(latent_channels=16, latent_size=8, patch_size=2, num_frames=4,
                                        frames_per_block=2, dim=32, num_layers=1, num_heads=4,
                                        text_vocab_size=len(vocabulary()), text_length=24)
    model.save_pretrained(tmp_path / "drafter")
    report_video.main(["block-loss", "--model", str(tmp_path / "drafter"), "--clips", "2"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) == {"prompt", "null prompt"} and len(out["prompt"]) == 2


def test_dtype_and_device_are_read_off_a_parameter():
    """``ParameterDtypeDeviceMixin``: the same answers as diffusers' ``ModelMixin`` (which walks every module on
    each access), after casting too; the continuous tokenizer has them as well."""
    from diffusers import ModelMixin

    from mmspec.models.tokenizers import load_zoo_tokenizer

    model = tiny(dtype=torch.float32)
    for dtype in (torch.float32, torch.float64, torch.float16):
        model = model.to(dtype)
        assert model.dtype == ModelMixin.dtype.fget(model) == dtype
        assert model.device == ModelMixin.device.fget(model) == torch.device("cpu")
    tokenizer = load_zoo_tokenizer("continuous").to(torch.float64)
    assert tokenizer.dtype == ModelMixin.dtype.fget(tokenizer) == torch.float64
