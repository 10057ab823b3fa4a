"""MARModel (models/mar.py): diffusion maths, head sampling, encoder padding, training step, the official
checkpoint layout (tested offline against a hand-written reference of the official forward), save/load."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pipeline_utils import assert_same_across_instances

from mmspec.models.mar import (
    DiffusionSchedule,
    MARModel,
    convert_mar_state_dict,
    cosine_betas,
    mar_config,
    spaced_timesteps,
)
from mmspec.models.recipes.mar_loss import mar_loss, sample_mask_ratio

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = dict(grid_size=3, token_dim=4, encoder_embed_dim=16, encoder_depth=2, encoder_num_heads=2, decoder_embed_dim=12,
            decoder_depth=1, decoder_num_heads=3, mlp_ratio=2.0, buffer_size=2, condition_type="class", num_classes=5,
            diffloss_d=2, diffloss_w=8, num_sampling_steps=6)


def tiny_model(seed: int = 0, **overrides) -> MARModel:
    torch.manual_seed(seed)
    model = MARModel(**{**TINY, **overrides}).double().eval()
    with torch.no_grad():  # MAR zero-initialises the head's modulations and output: give it some signal
        for param in model.head.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return model


# ---------------------------------------------------------------------------------------------------- diffusion


def test_cosine_schedule_and_respacing():
    betas = cosine_betas()
    abar = np.cumprod(1 - betas)
    t = np.arange(1, 1001) / 1000
    closed = np.cos((t + 0.008) / 1.008 * np.pi / 2) ** 2 / np.cos(0.008 / 1.008 * np.pi / 2) ** 2
    assert np.allclose(abar[:-1], closed[:-1], rtol=1e-9)  # the last beta is clipped at 0.999
    kept = spaced_timesteps(1000, 100)
    assert len(kept) == 100 and kept[0] == 0 and kept[-1] == 999
    assert spaced_timesteps(1000, 4) == [0, 333, 666, 999]
    spaced = DiffusionSchedule(100)
    assert np.allclose(spaced.alphas_cumprod, abar[kept], rtol=1e-12)  # respacing keeps alpha_bar at kept steps
    with pytest.raises(ValueError, match="num_diffusion_steps"):
        spaced_timesteps(1000, 0)


def test_p_mean_variance_is_the_posterior_of_the_predicted_x0():
    schedule = DiffusionSchedule(10)
    x = torch.randn(5, 3, dtype=torch.float64)
    eps, v = torch.randn(5, 3, dtype=torch.float64), torch.rand(5, 3, dtype=torch.float64) * 2 - 1
    i = 4
    mean, log_var, x0 = schedule.p_mean_variance(torch.cat([eps, v], -1), x, i)
    abar, abar_prev = schedule.alphas_cumprod[i], schedule.alphas_cumprod[i - 1]
    beta = 1 - abar / abar_prev
    assert torch.allclose(x0, (x - math.sqrt(1 - abar) * eps) / math.sqrt(abar))
    # posterior q(x_{i-1} | x_i, x0) mean, written from Bayes' rule
    expect = (math.sqrt(abar_prev) * beta * x0 + math.sqrt(1 - beta) * (1 - abar_prev) * x) / (1 - abar)
    assert torch.allclose(mean, expect)
    post_var = beta * (1 - abar_prev) / (1 - abar)
    frac = (v + 1) / 2
    assert torch.allclose(log_var, frac * math.log(beta) + (1 - frac) * math.log(post_var))


def test_sample_head_follows_its_recorded_gaussians_and_guidance():
    model = tiny_model()
    n, steps = 7, model.config.num_sampling_steps
    z = torch.randn(n, 12, dtype=torch.float64)
    noise = torch.randn(n, steps, 4, dtype=torch.float64)
    x0, means, variances = model.sample_head(z, noise, temperature=0.7, record=True)
    assert means.shape == variances.shape == (steps, n, 4)
    # replay: x_T = noise[0]; each step's Gaussian is the head's posterior at the replayed x (temperature^2
    # on the variance); x_{k+1} = mean_k + std_k * noise[k+1]; the last step returns its mean (no noise)
    schedule = DiffusionSchedule(steps)
    x = noise[:, 0]
    for k, i in enumerate(reversed(range(steps))):
        t = torch.full((n,), int(schedule.timesteps[i]))
        mean, log_var, _ = schedule.p_mean_variance(model.head(x, t, z), x, i)
        assert torch.allclose(mean, means[k]) and torch.allclose(log_var.exp() * 0.49, variances[k])
        x = mean + variances[k].sqrt() * noise[:, k + 1] if i > 0 else mean
    assert torch.allclose(x, x0) and torch.allclose(x0, means[-1])
    x_again, _, _ = model.sample_head(z, noise, temperature=0.7)
    assert torch.equal(x_again, x0)
    # guidance: z_uncond == z changes nothing at any scale; scale 1 equals the conditional chain
    same, _, _ = model.sample_head(z, noise, 0.7, guidance_scale=4.0, z_uncond=z)
    assert torch.allclose(same, x0)
    z_u = torch.randn_like(z)
    one, _, _ = model.sample_head(z, noise, 0.7, guidance_scale=1.0, z_uncond=z_u)
    assert torch.allclose(one, x0)
    guided, _, _ = model.sample_head(z, noise, 0.7, guidance_scale=torch.full((n,), 3.0, dtype=torch.float64),
                                     z_uncond=z_u)
    assert not torch.allclose(guided, x0)
    with pytest.raises(ValueError, match="noise must have shape"):
        model.sample_head(z, noise[:, :3])


def test_sampler_with_an_oracle_denoiser_returns_the_data_point():
    """A head that predicts the exact noise for a one-point data distribution: the respaced sampler (any
    step count, any temperature) must land on that point; a wrong timestep map would not."""
    model = tiny_model()
    full = DiffusionSchedule(None)
    point = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)

    class Oracle(torch.nn.Module):
        def forward(self, x, t, c):
            abar = torch.as_tensor(full.alphas_cumprod, dtype=x.dtype)[t].reshape(-1, 1)
            eps = (x - abar.sqrt() * point) / (1 - abar).sqrt()
            return torch.cat([eps, torch.zeros_like(eps)], -1)

    model.head = Oracle()
    for steps in (5, 25, 100):
        noise = torch.randn(3, steps, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(steps))
        x0, _, _ = model.sample_head(torch.zeros(3, 12, dtype=torch.float64), noise, temperature=1.3, num_steps=steps)
        assert torch.allclose(x0, point.expand(3, -1), atol=1e-8)

    # the same with a v-predicting oracle (v = sqrt(abar) eps - sqrt(1 - abar) x0)
    class VOracle(torch.nn.Module):
        def forward(self, x, t, c):
            abar = torch.as_tensor(full.alphas_cumprod, dtype=x.dtype)[t].reshape(-1, 1)
            eps = (x - abar.sqrt() * point) / (1 - abar).sqrt()
            v = abar.sqrt() * eps - (1 - abar).sqrt() * point
            return torch.cat([v, torch.zeros_like(v)], -1)

    v_model = tiny_model(prediction_type="v_prediction")
    v_model.head = VOracle()
    v_noise = torch.randn(3, 25, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x0, _, _ = v_model.sample_head(torch.zeros(3, 12, dtype=torch.float64), v_noise, num_steps=25)
    assert torch.allclose(x0, point.expand(3, -1), atol=1e-8)
    with pytest.raises(ValueError, match="prediction_type"):
        MARModel(**{**TINY, "prediction_type": "sample"})

    # clip_denoised bounds the predicted x0 inside every step (ADM's clip_denoised)
    schedule = DiffusionSchedule(25)
    x = torch.randn(3, 4, dtype=torch.float64)
    out = torch.cat([x + 1e-3, torch.zeros_like(x)], -1)          # a slightly wrong eps at t = 999
    _, _, x0 = schedule.p_mean_variance(out, x, 24)
    assert x0.abs().max() > 10                                      # divided by sqrt(alpha_bar_999) ~ 5e-5
    mean, _, x0 = schedule.p_mean_variance(out, x, 24, clip=3.0)
    assert x0.abs().max() <= 3.0
    _, _, unclipped = schedule.p_mean_variance(out, x, 24)
    expect = schedule.posterior_mean_coef1[24] * unclipped.clamp(-3, 3) + schedule.posterior_mean_coef2[24] * x
    assert torch.allclose(mean, expect)
    model.register_to_config(clip_denoised=3.0)
    x0, _, _ = model.sample_head(torch.zeros(3, 12, dtype=torch.float64), noise, num_steps=100)
    assert torch.allclose(x0, point.expand(3, -1), atol=1e-8)      # in-range predictions are untouched
    with pytest.raises(ValueError, match="clip_denoised"):
        MARModel(**{**TINY, "clip_denoised": 0.0})


def test_encoder_padding_equals_separate_rows():
    model = tiny_model()
    tokens = torch.randn(3, 9, 4, dtype=torch.float64)
    visible = torch.zeros(3, 9, dtype=torch.bool)
    visible[0, [1, 4]] = True
    visible[1, [0, 2, 5, 7, 8]] = True            # row 2 sees nothing
    cond = model.condition_embedding(torch.tensor([0, 3, 4]))
    together = model(tokens, visible, cond)
    for b in range(3):
        alone = model(tokens[b:b + 1], visible[b:b + 1], cond[b:b + 1])
        assert torch.allclose(together[b], alone[0], atol=1e-12)
    # invisible token values are never read
    scrambled = torch.where(visible[..., None], tokens, torch.randn_like(tokens))
    assert torch.allclose(model(scrambled, visible, cond), together, atol=1e-12)


@pytest.mark.parametrize("decoder_depth", [2, 0])
def test_forward_at_positions_equals_the_full_forward_at_those_rows(decoder_depth):
    """The last decoder block computed only at the sampled positions (keys from every position) gives the
    full forward's rows there: what the pipeline's iterations use to skip the positions they do not sample."""
    model = tiny_model(decoder_depth=decoder_depth)
    tokens = torch.randn(3, 9, 4, dtype=torch.float64)
    visible = torch.rand(3, 9, generator=torch.Generator().manual_seed(1)) < 0.5
    cond = model.condition_embedding(torch.tensor([0, 3, 4]))
    full = model(tokens, visible, cond)
    positions = torch.tensor([[2, 2, 8], [0, 5, 1], [7, 3, 3]])    # repeats allowed (padding)
    part = model(tokens, visible, cond, positions)
    assert part.shape == (3, 3, full.shape[-1])
    assert torch.allclose(part, full[torch.arange(3)[:, None], positions], atol=1e-12)
    assert not torch.allclose(part[:, 0], part[:, 1])                # the rows are not all the same
    with pytest.raises(ValueError, match="positions must be"):
        model(tokens, visible, cond, positions[0])
    with pytest.raises(ValueError, match=r"grid positions in \[0, 9\)"):
        model(tokens, visible, cond, positions + 7)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_mar_loss_learns_and_is_deterministic(prediction_type):
    model = tiny_model(prediction_type=prediction_type).float().train()
    tokens = torch.randn(4, 9, 4)
    labels = torch.tensor([0, 1, 2, 3])
    a = mar_loss(model, tokens, labels, generator=torch.Generator().manual_seed(1))
    b = mar_loss(model, tokens, labels, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and torch.isfinite(a)
    ratios = [sample_mask_ratio(model, torch.Generator().manual_seed(s)) for s in range(200)]
    assert min(ratios) >= model.config.mask_ratio_min and max(ratios) <= 1.0
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    losses = []
    for _ in range(60):
        loss = mar_loss(model, tokens, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:10])


def test_distillation_pulls_the_head_towards_the_teacher():
    """mar_loss's teacher term is distill_weight x the mean squared gap between the two heads' outputs on
    the same masked context and noise: zero against itself, positive against another model, and training on
    it closes the gap."""
    student = tiny_model().float().train()
    tokens, labels = torch.randn(4, 9, 4), torch.tensor([0, 1, 2, 3])

    def loss(**kwargs):
        return mar_loss(student, tokens, labels, generator=torch.Generator().manual_seed(1), **kwargs)

    assert torch.equal(loss(teacher=student, distill_weight=5.0), loss())
    teacher = tiny_model(seed=1).float().eval()

    def gap():
        with torch.no_grad():
            return ((loss(teacher=teacher, distill_weight=1.0) - loss()) / 1.0).item()

    before = gap()
    assert before > 0 and loss(teacher=teacher, distill_weight=3.0).item() == pytest.approx(loss().item() + 3 * before,
                                                                                             rel=1e-5)
    optimizer = torch.optim.Adam(student.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(60):
        value = mar_loss(student, tokens, labels, teacher=teacher, distill_weight=10.0)
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
    assert gap() < 0.5 * before
    assert all(p.grad is None for p in teacher.parameters())  # the teacher stays frozen


def test_text_condition_and_bad_inputs():
    model = tiny_model(condition_type="text", text_vocab_size=10, buffer_size=3)
    ids = torch.tensor([[-1, 2, 5], [1, 2, 3]])
    cond = model.condition_embedding(ids)
    assert torch.allclose(cond[0, 0], model.text_embedding.weight[10].double())  # padding row
    dropped = model.condition_embedding(ids, torch.tensor([True, False]))
    assert torch.allclose(dropped[0], model.fake_latent.expand(3, -1)) and torch.allclose(dropped[1], cond[1])
    with pytest.raises(ValueError, match=r"word ids \[B, 3\]"):
        model.condition_embedding(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="text_vocab_size"):
        model.condition_embedding(torch.tensor([[1, 2, 10]]))
    with pytest.raises(ValueError, match="class ids must be in"):
        tiny_model().condition_embedding(torch.tensor([5]))
    with pytest.raises(ValueError, match="text_vocab_size"):
        MARModel(**{**TINY, "condition_type": "text"})
    with pytest.raises(ValueError, match="condition_type"):
        MARModel(**{**TINY, "condition_type": "caption"})


# ---------------------------------------------------------------------------------------------------- checkpoints


def official_layout(config: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A random state dict with the key names and shapes of the official MAR code (models/mar.py and
    models/diffloss.py of LTH14/mar) for ``config``, written out by hand."""
    enc, dec = config["encoder_embed_dim"], config["decoder_embed_dim"]
    seq, buf, c, w = config["grid_size"] ** 2, config["buffer_size"], config["token_dim"], config["diffloss_w"]
    hidden_e, hidden_d = int(enc * config["mlp_ratio"]), int(dec * config["mlp_ratio"])
    shapes = {"class_emb.weight": (config["num_classes"], enc), "fake_latent": (1, enc),
              "z_proj.weight": (enc, c), "z_proj.bias": (enc,), "z_proj_ln.weight": (enc,), "z_proj_ln.bias": (enc,),
              "encoder_pos_embed_learned": (1, seq + buf, enc), "encoder_norm.weight": (enc,),
              "encoder_norm.bias": (enc,), "decoder_embed.weight": (dec, enc), "decoder_embed.bias": (dec,),
              "mask_token": (1, 1, dec), "decoder_pos_embed_learned": (1, seq + buf, dec),
              "decoder_norm.weight": (dec,), "decoder_norm.bias": (dec,), "diffusion_pos_embed_learned": (1, seq, dec),
              "diffloss.net.time_embed.mlp.0.weight": (w, 256), "diffloss.net.time_embed.mlp.0.bias": (w,),
              "diffloss.net.time_embed.mlp.2.weight": (w, w), "diffloss.net.time_embed.mlp.2.bias": (w,),
              "diffloss.net.cond_embed.weight": (w, dec), "diffloss.net.cond_embed.bias": (w,),
              "diffloss.net.input_proj.weight": (w, c), "diffloss.net.input_proj.bias": (w,),
              "diffloss.net.final_layer.linear.weight": (2 * c, w), "diffloss.net.final_layer.linear.bias": (2 * c,),
              "diffloss.net.final_layer.adaLN_modulation.1.weight": (2 * w, w),
              "diffloss.net.final_layer.adaLN_modulation.1.bias": (2 * w,)}
    for side, dim, hidden, depth in (("encoder", enc, hidden_e, config["encoder_depth"]),
                                     ("decoder", dec, hidden_d, config["decoder_depth"])):
        for i in range(depth):
            p = f"{side}_blocks.{i}."
            shapes.update({p + "norm1.weight": (dim,), p + "norm1.bias": (dim,), p + "attn.qkv.weight": (3 * dim, dim),
                           p + "attn.qkv.bias": (3 * dim,), p + "attn.proj.weight": (dim, dim),
                           p + "attn.proj.bias": (dim,), p + "norm2.weight": (dim,), p + "norm2.bias": (dim,),
                           p + "mlp.fc1.weight": (hidden, dim), p + "mlp.fc1.bias": (hidden,),
                           p + "mlp.fc2.weight": (dim, hidden), p + "mlp.fc2.bias": (dim,)})
    for i in range(config["diffloss_d"]):
        p = f"diffloss.net.res_blocks.{i}."
        shapes.update({p + "in_ln.weight": (w,), p + "in_ln.bias": (w,), p + "mlp.0.weight": (w, w),
                       p + "mlp.0.bias": (w,), p + "mlp.2.weight": (w, w), p + "mlp.2.bias": (w,),
                       p + "adaLN_modulation.1.weight": (3 * w, w), p + "adaLN_modulation.1.bias": (3 * w,)})
    return {k: 0.3 * torch.randn(s, generator=generator, dtype=torch.float64) for k, s in shapes.items()}


def official_forward(sd: dict, config: dict, tokens, mask, labels) -> torch.Tensor:
    """The official forward_mae_encoder / forward_mae_decoder (equal mask counts per row), from official keys."""
    def ln(x, p, eps=1e-6):
        return F.layer_norm(x, x.shape[-1:], sd[p + ".weight"], sd[p + ".bias"], eps)

    def lin(x, p):
        return F.linear(x, sd[p + ".weight"], sd[p + ".bias"])

    def block(x, p, heads):
        b, n, d = x.shape
        qkv = lin(ln(x, p + "norm1"), p + "attn.qkv").reshape(b, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(d // heads)).softmax(-1)
        x = x + lin((att @ v).transpose(1, 2).reshape(b, n, d), p + "attn.proj")
        return x + lin(F.gelu(lin(ln(x, p + "norm2"), p + "mlp.fc1")), p + "mlp.fc2")

    buf = config["buffer_size"]
    bsz = tokens.shape[0]
    x = lin(tokens, "z_proj")
    x = torch.cat([torch.zeros(bsz, buf, x.shape[-1], dtype=x.dtype), x], dim=1)
    mask_with_buffer = torch.cat([torch.zeros(bsz, buf, dtype=x.dtype), mask], dim=1)
    x[:, :buf] = sd["class_emb.weight"][labels].unsqueeze(1)
    x = ln(x + sd["encoder_pos_embed_learned"], "z_proj_ln")
    x = x[(1 - mask_with_buffer).nonzero(as_tuple=True)].reshape(bsz, -1, x.shape[-1])
    for i in range(config["encoder_depth"]):
        x = block(x, f"encoder_blocks.{i}.", config["encoder_num_heads"])
    x = lin(ln(x, "encoder_norm"), "decoder_embed")
    pad = sd["mask_token"].repeat(bsz, mask_with_buffer.shape[1], 1).clone()
    pad[(1 - mask_with_buffer).nonzero(as_tuple=True)] = x.reshape(-1, x.shape[-1])
    x = pad + sd["decoder_pos_embed_learned"]
    for i in range(config["decoder_depth"]):
        x = block(x, f"decoder_blocks.{i}.", config["decoder_num_heads"])
    return ln(x, "decoder_norm")[:, buf:] + sd["diffusion_pos_embed_learned"]


def official_head(sd: dict, x, t, c) -> torch.Tensor:
    """The official SimpleMLPAdaLN forward, from official keys."""
    def lin(h, p):
        return F.linear(h, sd[f"diffloss.net.{p}.weight"], sd[f"diffloss.net.{p}.bias"])

    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    temb = torch.cat([torch.cos(args), torch.sin(args)], -1).double()
    y = lin(F.silu(lin(temb, "time_embed.mlp.0")), "time_embed.mlp.2") + lin(c, "cond_embed")
    h = lin(x, "input_proj")
    i = 0
    while f"diffloss.net.res_blocks.{i}.in_ln.weight" in sd:
        p = f"res_blocks.{i}"
        shift, scale, gate = lin(F.silu(y), p + ".adaLN_modulation.1").chunk(3, -1)
        normed = F.layer_norm(h, h.shape[-1:], sd[f"diffloss.net.{p}.in_ln.weight"], sd[f"diffloss.net.{p}.in_ln.bias"], 1e-6)
        h = h + gate * lin(F.silu(lin(normed * (1 + scale) + shift, p + ".mlp.0")), p + ".mlp.2")
        i += 1
    shift, scale = lin(F.silu(y), "final_layer.adaLN_modulation.1").chunk(2, -1)
    return lin(F.layer_norm(h, h.shape[-1:], eps=1e-6) * (1 + scale) + shift, "final_layer.linear")


def test_official_checkpoint_layout_loads_and_matches_the_official_forward(tmp_path):
    generator = torch.Generator().manual_seed(0)
    ema = official_layout(TINY, generator)
    raw = official_layout(TINY, generator)
    path = tmp_path / "checkpoint-last.pth"
    torch.save({"model": raw, "model_ema": ema, "epoch": 3, "args": argparse.Namespace(model="mar_tiny")}, path)
    model = MARModel.from_mar_checkpoint(path, encoder_num_heads=2, decoder_num_heads=3, num_sampling_steps=6)
    assert model.dtype == torch.float64
    for key in ("encoder_depth", "decoder_depth", "grid_size", "token_dim", "buffer_size", "diffloss_d", "diffloss_w",
                "num_classes", "mlp_ratio"):
        assert model.config[key] == TINY[key], key
    mapped = convert_mar_state_dict(ema)
    assert set(mapped) == set(model.state_dict())
    assert torch.equal(model.head.blocks[1].modulation.weight, ema["diffloss.net.res_blocks.1.adaLN_modulation.1.weight"])
    # the encoder/decoder and the head compute what the official code computes with those weights
    tokens = torch.randn(2, 9, 4, dtype=torch.float64)
    mask = torch.zeros(2, 9, dtype=torch.float64)
    mask[0, [0, 3, 4, 8]] = 1
    mask[1, [1, 2, 5, 6]] = 1
    labels = torch.tensor([1, 4])
    ours = model(tokens, mask == 0, model.condition_embedding(labels))
    assert torch.allclose(ours, official_forward(ema, TINY, tokens, mask, labels), atol=1e-10)
    x, c = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 12, dtype=torch.float64)
    t = torch.tensor([0, 17, 250, 999, 3])
    assert torch.allclose(model.head(x, t, c), official_head(ema, x, t, c), atol=1e-10)
    # use_ema=False reads "model"
    plain = MARModel.from_mar_checkpoint(path, use_ema=False, encoder_num_heads=2, decoder_num_heads=3)
    assert torch.equal(plain.z_proj.weight, raw["z_proj.weight"])


def test_official_checkpoint_errors(tmp_path):
    generator = torch.Generator().manual_seed(0)
    sd = official_layout(TINY, generator)
    with pytest.raises(ValueError, match="unknown keys"):
        convert_mar_state_dict({**sd, "vae.encoder.conv_in.weight": torch.zeros(1)})
    broken = dict(sd)
    del broken["diffloss.net.res_blocks.0.mlp.2.bias"]
    path = tmp_path / "broken.pth"
    torch.save({"model_ema": broken}, path)
    with pytest.raises(ValueError, match=r"missing keys.*head\.blocks\.0\.fc2\.bias"):
        MARModel.from_mar_checkpoint(path, encoder_num_heads=2, decoder_num_heads=3)
    with pytest.raises(FileNotFoundError):
        MARModel.from_mar_checkpoint(tmp_path / "absent.pth")
    base = mar_config("mar_base")
    assert (base["encoder_depth"], base["diffloss_d"], base["diffloss_w"], base["grid_size"]) == (12, 6, 1024, 16)
    assert mar_config("mar_huge")["encoder_embed_dim"] == 1280
    with pytest.raises(ValueError, match="variant"):
        mar_config("mar_giant")


def test_save_and_load_round_trip(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "mar")
    loaded = MARModel.from_pretrained(tmp_path / "mar").double().eval()
    tokens = torch.randn(2, 9, 4, dtype=torch.float64)
    visible = torch.rand(2, 9) < 0.5
    cond = model.condition_embedding(torch.tensor([1, 2]))
    assert_same_across_instances(loaded(tokens, visible, loaded.condition_embedding(torch.tensor([1, 2]))),
                                 model(tokens, visible, cond))
    assert loaded.config.num_sampling_steps == 6


def test_training_recipe_runs_resumes_and_builds_a_pipeline(tmp_path):
    """train_mar on a tiny set: a resumed run equals an unbroken one (EMA included); report_mar build
    writes a loadable pipeline folder."""
    from mmspec.models.recipes import report_mar, train_mar

    common = ["--train-images", "40", "--dim", "16", "--heads", "2", "--encoder-depth", "1", "--decoder-depth", "1",
              "--head-depth", "1", "--head-width", "16", "--batch", "4", "--save-every", "2", "--threads", "1",
              "--num-sampling-steps", "4"]
    train_mar.main([*common, "--steps", "4", "--work", str(tmp_path / "a"), "--out", str(tmp_path / "a_model")])
    train_mar.main([*common, "--steps", "2", "--work", str(tmp_path / "b"), "--out", str(tmp_path / "b_model")])
    train_mar.main([*common, "--steps", "4", "--work", str(tmp_path / "b"), "--out", str(tmp_path / "b_model")])
    a = MARModel.from_pretrained(tmp_path / "a_model")
    b = MARModel.from_pretrained(tmp_path / "b_model")
    from safetensors.torch import load_file

    on_disk = load_file(str(tmp_path / "a_model" / "diffusion_pytorch_model.safetensors"))
    assert all(t.dtype == torch.float16 for t in on_disk.values()) and a.config.num_sampling_steps == 4
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    # --stop-at runs the same 4-step schedule in two pieces: identical to a_model
    for stop in ("2", "4"):
        train_mar.main([*common, "--steps", "4", "--stop-at", stop, "--work", str(tmp_path / "e"),
                        "--out", str(tmp_path / "e_model")])
    e = MARModel.from_pretrained(tmp_path / "e_model")
    for (name, pa), pe in zip(a.state_dict().items(), e.state_dict().values()):
        assert torch.equal(pa, pe), name
    # --init starts a later stage from a_model: with lr 0 and no EMA the saved weights are a_model's
    train_mar.main([*common, "--steps", "1", "--lr", "0", "--ema", "0", "--init", str(tmp_path / "a_model"),
                    "--work", str(tmp_path / "c"), "--out", str(tmp_path / "c_model")])
    c = MARModel.from_pretrained(tmp_path / "c_model")
    for (name, pa), pc in zip(a.state_dict().items(), c.state_dict().values()):
        assert torch.equal(pa, pc), name
    with pytest.raises(FileNotFoundError, match="no trained MAR model"):
        train_mar.main([*common, "--steps", "1", "--init", str(tmp_path / "missing"), "--work", str(tmp_path / "d"),
                        "--out", str(tmp_path / "d_model")])
    # --distill-from: a draft that also matches a_model's head (a smaller head here); bad teachers are named
    train_mar.main([*common, "--steps", "2", "--head-width", "8", "--distill-from", str(tmp_path / "a_model"),
                    "--work", str(tmp_path / "f"), "--out", str(tmp_path / "f_model")])
    assert MARModel.from_pretrained(tmp_path / "f_model").config.diffloss_w == 8
    with pytest.raises(FileNotFoundError, match="--distill-from: no trained MAR model"):
        train_mar.main([*common, "--steps", "1", "--distill-from", str(tmp_path / "missing"),
                        "--work", str(tmp_path / "g"), "--out", str(tmp_path / "g_model")])
    with pytest.raises(ValueError, match="--distill-weight must be > 0"):
        train_mar.main([*common, "--steps", "1", "--distill-from", str(tmp_path / "a_model"), "--distill-weight", "0",
                        "--work", str(tmp_path / "g"), "--out", str(tmp_path / "g_model")])
    with pytest.raises(ValueError, match="its grid_size is 3, this model's 8"):
        train_mar.load_teacher(_saved(tiny_model(token_dim=16, condition_type="text", text_vocab_size=a.config.text_vocab_size,
                                                 buffer_size=a.config.buffer_size), tmp_path / "small_grid"),
                               a, a.config.text_vocab_size, 1.0)
    report_mar.main(["build", "--target", str(tmp_path / "a_model"), "--draft", str(tmp_path / "b_model"),
                     "--folder", str(tmp_path / "pipe")])
    from mmspec.pipelines.continuous_ar_image import ContinuousARImagePipeline

    pipe = ContinuousARImagePipeline.from_pretrained(tmp_path / "pipe")
    pipe.set_progress_bar_config(disable=True)
    out = pipe("a red circle", method="cspd", num_iter=4, generator=torch.Generator().manual_seed(0), output_type="np")
    assert out.images.shape == (1, 32, 32, 3) and out.stats.tokens == 64


def _saved(model: MARModel, folder):
    model.save_pretrained(folder)
    return folder


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without a CUDA GPU")
def test_training_recipe_on_a_missing_gpu_says_so(tmp_path):
    from mmspec.models.recipes import train_mar, train_t2i, train_video

    for recipe in (train_mar, train_t2i, train_video):
        with pytest.raises(RuntimeError, match="--device cuda: torch sees no CUDA GPU"):
            recipe.main(["--device", "cuda", "--work", str(tmp_path / "w"), "--out", str(tmp_path / "m")])


def test_sincos_position_start():
    from mmspec.models.mar import sincos_2d

    table = sincos_2d(3, 8)
    assert table.shape == (9, 8)
    # channels: [sin(row w), cos(row w), sin(col w), cos(col w)] with w = (1, 0.01)
    assert torch.allclose(table[0], torch.tensor([0.0, 0, 1, 1, 0, 0, 1, 1]))
    s1, c1, s2, c2 = math.sin(1.0), math.cos(1.0), math.sin(0.01), math.cos(0.01)
    assert torch.allclose(table[4], torch.tensor([s1, s2, c1, c2, s1, s2, c1, c2]))  # row 1, column 1
    assert torch.allclose(table[1, :4], table[0, :4]) and not torch.allclose(table[1, 4:], table[0, 4:])
    model = MARModel(**{**TINY, "encoder_embed_dim": 16, "sincos_init": True})
    assert torch.equal(model.encoder_pos_embed[0, 2:], sincos_2d(3, 16))
    assert model.encoder_pos_embed[0, :2].abs().max() < 0.2                  # buffer slots keep N(0, 0.02)
    with pytest.raises(ValueError, match="divisible by 4"):
        sincos_2d(3, 6)
