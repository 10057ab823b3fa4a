"""ContinuousARImagePipeline (pipelines/continuous_ar_image.py): target-only MAR decoding and CSpD.

Tiny random MAR models in float64. What is shown: an identical draft is accepted everywhere and
reproduces ``method="none"`` exactly (every verification order; "round" context needs gamma = 1, the
"exact" context any gamma), while the "round" context with gamma > 1 is not exact (so the test can fail);
pre-filled tokens are the target's; the residual sampler matches its target density (KS tests on
Gaussian cases); batches of several prompts; save/load; bad input.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pipeline_utils import assert_same_across_instances
from scipy import stats as sps

from mmspec.continuous import cspd_verify
from mmspec.methods.cspd import CSpDConfig
from mmspec.models.mar import MARModel
from mmspec.models.text import WordTokenizer
from mmspec.models.tokenizers import ContinuousTokenizer
from mmspec.pipelines.continuous_ar_image import (
    BoundMAR,
    ContinuousARImagePipeline,
    CSpDStats,
    mar_schedule,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WORDS = ["a", "red", "blue", "circle", "square", "squares", "and", "two"]


def tiny_mar(seed: int, depth: int = 2, width: int = 24, condition: str = "class", token_dim: int = 4,
             steps: int = 5) -> MARModel:
    torch.manual_seed(seed)
    kwargs = dict(condition_type="text", text_vocab_size=len(WORDS)) if condition == "text" else dict(num_classes=5)
    model = MARModel(grid_size=4, token_dim=token_dim, encoder_embed_dim=width, encoder_depth=depth,
                     encoder_num_heads=2, decoder_embed_dim=width, decoder_depth=depth, decoder_num_heads=2,
                     buffer_size=4, diffloss_d=2, diffloss_w=16, num_sampling_steps=steps, **kwargs)
    with torch.no_grad():  # small random head outputs: tokens stay O(1)
        for param in model.head.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model.double().eval()


def tiny_vae(token_dim: int = 4) -> ContinuousTokenizer:
    torch.manual_seed(0)
    return ContinuousTokenizer(latent_dim=token_dim, hidden_dim=16, patch_size=4, image_size=16).double()


def make_pipe(draft: MARModel | None, condition: str = "class", target_seed: int = 0) -> ContinuousARImagePipeline:
    words = WordTokenizer(WORDS) if condition == "text" else None
    pipe = ContinuousARImagePipeline(tiny_mar(target_seed, condition=condition), tiny_vae(), draft_transformer=draft,
                                     text_tokenizer=words)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, method="none", seed=0, **kwargs):
    kwargs.setdefault("class_labels", [1, 3, 4])
    kwargs.setdefault("num_iter", 8)
    return pipe(method=method, generator=torch.Generator().manual_seed(seed), output_type="latent", **kwargs)


# ---------------------------------------------------------------------------------------------------- schedule


def test_mar_schedule():
    one_each = mar_schedule(16, 16)
    assert one_each.starts == tuple(range(17))                      # num_iter = L: one token per iteration
    coarse = mar_schedule(64, 16)
    sizes = np.diff(coarse.starts)
    assert coarse.starts[-1] == 64 and (sizes >= 1).all() and sizes[0] == 1 and sizes[-1] > 1
    assert coarse.mask_lens[-1] == 1                                # MAR's last-iteration quirk
    guidance = coarse.guidance(3.0, "linear", 64)
    assert guidance[0] == pytest.approx(1 + 2 * (64 - coarse.mask_lens[0]) / 64) and guidance[-1] == pytest.approx(1 + 2 * 63 / 64)
    assert coarse.iteration_of(torch.tensor([0, 1, 63])).tolist() == [0, 1, 15]
    with pytest.raises(ValueError, match="num_iter"):
        mar_schedule(16, 17)


# ---------------------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("verify_order", ["chain", "iteration", "independent"])
@pytest.mark.parametrize("verify_context,gamma", [("exact", 3), ("exact", 1), ("round", 1)])
def test_identical_draft_is_accepted_and_reproduces_the_target(verify_order, verify_context, gamma):
    pipe = make_pipe(tiny_mar(0))  # the draft is the target's twin
    base = run(pipe, guidance_scale=3.0)
    out = run(pipe, CSpDConfig(draft_length=gamma, verify_order=verify_order, verify_context=verify_context,
                               prefill_ratio=0.1), guidance_scale=3.0)
    assert torch.equal(out.tokens, base.tokens)
    assert out.stats.acceptance_rate == 1.0 and out.stats.drafted_tokens > 0
    assert out.stats.drafted_tokens + out.stats.prefill_tokens == 3 * 16
    assert out.drafted.sum() == out.stats.accepted_tokens
    assert out.stats.target_calls < base.stats.target_calls or gamma == 1


def test_identical_text_model_with_batch_and_images_per_prompt():
    pipe = make_pipe(tiny_mar(0, condition="text"), condition="text")
    prompts = ["a red circle", "two blue squares and a circle", "a square"]
    base = run(pipe, prompt=prompts, class_labels=None, num_images_per_prompt=2)
    out = run(pipe, CSpDConfig(verify_context="exact", verify_order="chain", draft_length=4, prefill_ratio=0.05),
              prompt=prompts, class_labels=None, num_images_per_prompt=2)
    assert base.tokens.shape == (6, 4, 4, 4)
    assert torch.equal(out.tokens, base.tokens) and out.stats.acceptance_rate == 1.0
    # each row is its own image: a batch of one prompt gives the same images as that prompt's rows
    alone = run(pipe, prompt=prompts[1:2], class_labels=None, num_images_per_prompt=2)
    assert alone.tokens.shape[0] == 2 and not torch.equal(alone.tokens, base.tokens[2:4])  # other seeds per row
    assert torch.isfinite(base.tokens).all()


def test_round_context_with_several_iterations_is_not_exact():
    """The official code's context: later draft iterations saw drafted tokens the target row does not,
    so even an identical draft is rejected somewhere (this is why the exactness tests can fail)."""
    pipe = make_pipe(tiny_mar(0))
    out = run(pipe, CSpDConfig(draft_length=4, verify_context="round", verify_order="independent", prefill_ratio=0.0))
    assert out.stats.acceptance_rate < 1.0
    assert out.stats.target_calls == 2  # 8 iterations, 4 per round


def test_log_ratio_of_identical_chains_is_zero_and_verification_goes_through_the_core():
    pipe = make_pipe(None)
    model = pipe.transformer
    z = torch.randn(6, 24, dtype=torch.float64)
    noise = torch.randn(6, 5, 4, dtype=torch.float64)
    x0, means, variances = model.sample_head(z, noise, record=True)
    result = cspd_verify(x0, means, variances, means.clone(), variances.clone(), torch.Generator().manual_seed(0))
    assert torch.allclose(result.log_ratio, torch.zeros(6, dtype=torch.float64), atol=1e-9)
    assert result.accepted.all() and torch.equal(result.samples, x0)


def test_prefill_tokens_are_the_targets_and_different_drafts_are_verified():
    pipe = make_pipe(tiny_mar(7, depth=1, width=16))
    base = run(pipe)
    for order in ("chain", "independent"):
        for context in ("round", "exact"):
            config = CSpDConfig(prefill_ratio=0.3, draft_length=2, verify_order=order, verify_context=context,
                                density_temperature=50.0)
            out = run(pipe, config)
            prefill = math.ceil(0.3 * 16)
            schedule = mar_schedule(16, 8)
            first_after = next(s for s in schedule.starts if s >= prefill)
            assert out.stats.prefill_tokens == 3 * first_after
            # the pre-filled tokens sit at the first positions of each row's generation order: same as "none"
            generator = torch.Generator().manual_seed(0)
            orders = torch.stack([torch.randperm(16, generator=generator) for _ in range(3)])
            flat_base, flat_out = base.tokens.reshape(3, 16, 4), out.tokens.reshape(3, 16, 4)
            for b in range(3):
                pos = orders[b, :first_after]
                assert torch.equal(flat_out[b, pos], flat_base[b, pos])
                assert not out.drafted.reshape(3, 16)[b, pos].any()
            assert torch.isfinite(out.tokens).all()
            assert out.stats.draft_calls > 0 and out.stats.drafted_tokens > 0
            assert 0.0 <= out.stats.acceptance_rate <= 1.0
            if order == "independent":
                assert out.stats.drafted_tokens == 3 * (16 - first_after)
            again = run(pipe, config)
            assert torch.equal(again.tokens, out.tokens)  # one generator fixes everything


def test_stats_and_output_types():
    pipe = make_pipe(tiny_mar(3, depth=1))
    base = run(pipe, num_iter=8)
    assert base.stats.target_calls == 8 and base.stats.draft_calls == 0
    assert base.stats.mean_accepted_length == pytest.approx(16 / 8)
    merged = CSpDStats.merge([base.stats, base.stats])
    assert merged.target_calls == 16 and merged.tokens == 2 * 48
    images = pipe(class_labels=[0, 1], num_iter=4, generator=torch.Generator().manual_seed(0), output_type="np").images
    assert images.shape == (2, 16, 16, 3) and images.min() >= 0 and images.max() <= 1
    pil = pipe(class_labels=0, num_iter=4, output_type="pil").images
    assert pil[0].size == (16, 16)
    seen = []

    def callback(p, step, timestep, info):  # diffusers' convention
        seen.append((int(info["num_generated"].min()), timestep, sorted(info)))
        return info

    run(pipe, "cspd", callback_on_step_end=callback)
    assert seen[-1][0] == 16 and [n for n, _, _ in seen] == sorted(n for n, _, _ in seen)
    assert seen[-1][1] == 16 and seen[0][2] == ["drafted", "latents", "num_generated"]
    images, tokens, stats, drafted = pipe(class_labels=[0, 1], num_iter=4, generator=torch.Generator().manual_seed(0),
                                          output_type="latent", return_dict=False)
    again = pipe(class_labels=[0, 1], num_iter=4, generator=torch.Generator().manual_seed(0), output_type="latent")
    assert images is None and torch.equal(tokens, again.tokens) and torch.equal(drafted, again.drafted)


# ---------------------------------------------------------------------------------------------------- residual


def _gauss_chain(mu_last: float, var_last: float, var_early: list[float], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step means/variances ``[T, n, 1]`` of a 1-D chain whose last step is N(mu_last, var_last)."""
    variances = torch.tensor([*var_early, var_last], dtype=torch.float64).reshape(-1, 1, 1).expand(-1, n, 1).clone()
    means = torch.zeros_like(variances)
    means[-1] = mu_last
    return means, variances


def _residual_cdf(grid: np.ndarray, density: np.ndarray) -> np.ndarray:
    cdf = np.cumsum(density)
    return cdf / cdf[-1]


@pytest.mark.parametrize("log_det,tau", [(0.0, 1.0), (0.4, 1.0), (-0.3, 1.0), (0.0, 2.0)])
def test_residual_sampler_matches_its_target_density(log_det, tau):
    """Drafts x ~ q = N(0.8, 0.7^2), target p = N(0, 1), a log-determinant offset L (from earlier step
    variances) and a density temperature tau: the accepted fraction equals the integral of
    min(q, e^L p_tau / p_tau-normaliser...), and the residual samples follow p(y) max(0, 1 - 1/r(y)) with
    r(y) = e^L p_tau(y) / q_tau(y) (= norm(max(0, e^L p - q)) for tau = 1). KS test at p > 1e-3 on 60k
    samples; the bound on tries is large enough that no fallback happens."""
    n = 60000
    var_q, var_p = 0.49, 1.0
    # earlier-step variances giving the log-det offset L = 0.5 * (log v_q - log v_p)
    early_q, early_p = [1.0], [math.exp(-2 * log_det)]
    d_means, d_vars = _gauss_chain(0.8, var_q, early_q, n)
    t_means, t_vars = _gauss_chain(0.0, var_p, early_p, n)
    generator = torch.Generator().manual_seed(0)
    x = 0.8 + math.sqrt(var_q) * torch.randn(n, 1, generator=generator, dtype=torch.float64)
    result = cspd_verify(x, d_means, d_vars, t_means, t_vars, generator, density_temperature=tau, max_tries=200)
    assert result.num_fallbacks == 0
    grid = np.linspace(-8, 8, 40001)
    p_tau = sps.norm.pdf(grid, 0.0, tau * math.sqrt(var_p))
    q_tau = sps.norm.pdf(grid, 0.8, tau * math.sqrt(var_q))
    r = math.exp(log_det) * p_tau / q_tau
    # acceptance: E_q[min(1, r(x))]
    q = sps.norm.pdf(grid, 0.8, math.sqrt(var_q))
    expected_accept = np.trapezoid(q * np.minimum(1, r), grid)
    assert abs(result.accepted.double().mean().item() - expected_accept) < 4 * math.sqrt(expected_accept / n) + 1e-3
    assert torch.equal(result.samples[result.accepted], x[result.accepted])
    # residual: proposals from the target's untempered last-step Gaussian, kept w.p. max(0, 1 - 1/r)
    p = sps.norm.pdf(grid, 0.0, math.sqrt(var_p))
    residual_density = p * np.maximum(0.0, 1 - 1 / r)
    cdf = _residual_cdf(grid, residual_density)
    residual = result.samples[~result.accepted].squeeze(1).numpy()
    assert residual.size > 3000
    ks = sps.kstest(residual, lambda v: np.interp(v, grid, cdf))
    assert ks.pvalue > 1e-3, ks
    # and the test can fail: the same residual against the plain target density
    wrong = sps.kstest(residual, lambda v: sps.norm.cdf(v, 0.0, 1.0))
    assert wrong.pvalue < 1e-6
    if log_det == 0.0 and tau == 1.0:  # the whole output is the target distribution
        full = sps.kstest(result.samples.squeeze(1).numpy(), lambda v: sps.norm.cdf(v, 0.0, 1.0))
        assert full.pvalue > 1e-3, full


def test_residual_fallback_is_counted():
    n = 2000
    d_means, d_vars = _gauss_chain(0.0, 1.0, [1.0], n)
    t_means, t_vars = _gauss_chain(0.05, 1.0, [1.0], n)  # nearly equal: rejections rare, residual hard to hit
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(n, 1, generator=generator, dtype=torch.float64)
    result = cspd_verify(x, d_means, d_vars, t_means, t_vars, generator, max_tries=1)
    rejected = int((~result.accepted).sum())
    assert rejected > 0 and 0 < result.num_fallbacks <= rejected


# ---------------------------------------------------------------------------------------------------- io, errors


def test_save_and_load(tmp_path):
    pipe = make_pipe(tiny_mar(5, depth=1, condition="text"), condition="text")
    pipe.save_pretrained(tmp_path / "pipe")
    assert (tmp_path / "pipe" / "text_tokenizer" / "tokenizer.json").is_file()
    loaded = ContinuousARImagePipeline.from_pretrained(tmp_path / "pipe", torch_dtype=torch.float64)
    loaded.set_progress_bar_config(disable=True)
    a = run(pipe, "cspd", prompt="a red circle", class_labels=None)
    b = run(loaded, "cspd", prompt="a red circle", class_labels=None)
    assert_same_across_instances(b.tokens, a.tokens)
    no_draft = ContinuousARImagePipeline.from_pretrained(tmp_path / "pipe", draft_transformer=None)
    assert no_draft.draft_transformer is None and no_draft.transformer.dtype == torch.float32
    with pytest.raises(ValueError, match="needs a draft_transformer"):
        no_draft("a red circle", method="cspd")
    with pytest.raises(FileNotFoundError):
        ContinuousARImagePipeline.from_pretrained(tmp_path / "absent")


def test_bad_input():
    with pytest.raises(ValueError, match="same dimension"):
        ContinuousARImagePipeline(tiny_mar(0), tiny_vae(), draft_transformer=tiny_mar(1, token_dim=6))
    with pytest.raises(ValueError, match="latents have 6 channels"):
        ContinuousARImagePipeline(tiny_mar(0), tiny_vae(6))
    with pytest.raises(ValueError, match="condition_type"):
        ContinuousARImagePipeline(tiny_mar(0), tiny_vae(), draft_transformer=tiny_mar(1, condition="text"))
    pipe = make_pipe(tiny_mar(1, depth=1))
    bad_settings = [
        (dict(draft_length=0), r"CSpDConfig.draft_length must be an integer in \[1, 1024\]"),
        (dict(draft_length=-2), "CSpDConfig.draft_length"),
        (dict(draft_length=2.0), "CSpDConfig.draft_length"),
        (dict(prefill_ratio=1.0), r"CSpDConfig.prefill_ratio must be a number in \[0.0, 1.0\)"),
        (dict(prefill_ratio=-0.1), "CSpDConfig.prefill_ratio"),
        (dict(verify_order="tree"), "CSpDConfig.verify_order"),
        (dict(verify_context="all"), "CSpDConfig.verify_context"),
        (dict(density_temperature=0.0), "CSpDConfig.density_temperature"),
        (dict(max_tries=0), "CSpDConfig.max_tries"),
    ]
    for fields, message in bad_settings:
        with pytest.raises(ValueError, match=message):
            pipe(class_labels=[1], method=CSpDConfig(**fields))
    bad = [
        (dict(method="eagle"), "method"),
        (dict(num_iter=17), "num_iter"),
        (dict(num_iter=0), "num_iter"),
        (dict(num_diffusion_steps=0), "num_diffusion_steps"),
        (dict(temperature=0.0), "temperature"),
        (dict(cfg_schedule="cosine"), "cfg_schedule"),
        (dict(output_type="latents"), "output_type"),
        (dict(class_labels=[7]), "class_labels"),
        (dict(class_labels=None, prompt="a red circle"), "class-conditioned"),
        (dict(class_labels=None), "exactly one"),
        (dict(num_images_per_prompt=0), "num_images_per_prompt"),
        (dict(callback_on_step_end=3), "callback_on_step_end must be callable"),
    ]
    for kwargs, message in bad:
        call = {"class_labels": [1], **kwargs}
        with pytest.raises(ValueError, match=message):
            pipe(**call)
    text_pipe = make_pipe(None, condition="text")
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        text_pipe("a green circle")
    with pytest.raises(ValueError, match="empty"):
        text_pipe([])


@pytest.mark.slow
def test_benchmark_script_writes_its_table(tmp_path):
    """bench_continuous on a tiny random text pipeline over the world's vocabulary: one row per
    configuration and batch size, the noise line, the JSON beside it."""
    import json

    from mmspec.evaluation import bench_continuous
    from mmspec.world import vocabulary

    torch.manual_seed(0)
    words = WordTokenizer(vocabulary())

    def model(depth: int) -> MARModel:
        return MARModel(grid_size=8, token_dim=16, encoder_embed_dim=16, encoder_depth=depth, encoder_num_heads=2,
                        decoder_embed_dim=16, decoder_depth=depth, decoder_num_heads=2, buffer_size=12,
                        condition_type="text", text_vocab_size=len(words), diffloss_d=1, diffloss_w=16,
                        num_sampling_steps=3, clip_denoised=7.0)

    from mmspec.models.tokenizers import load_zoo_tokenizer

    ContinuousARImagePipeline(model(2), load_zoo_tokenizer("continuous"), draft_transformer=model(1),
                              text_tokenizer=words).save_pretrained(tmp_path / "pipe")
    out = tmp_path / "bench.md"
    code = bench_continuous.main(["--pipeline", str(tmp_path / "pipe"), "--batch-sizes", "1", "2", "--speed-prompts", "2",
                                  "--quality-prompts", "1", "--quality-seeds", "2", "--repeats", "1", "--threads", "1",
                                  "--num-iter", "8", "--out", str(out)])
    assert code == 0
    table = out.read_text()
    rows = [line for line in table.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    timed = [c for c in bench_continuous.DEFAULT_CONFIGS.values() if "batches" not in c]
    assert len(rows) == 2 * len(timed) + sum(b in (1, 2) for c in bench_continuous.DEFAULT_CONFIGS.values()
                                             for b in c.get("batches", []))
    assert "Noise level" in table and "Command: `python -m mmspec.evaluation.bench_continuous" in table
    data = json.loads(out.with_suffix(".json").read_text())
    assert set(data["quality"]) == {*bench_continuous.DEFAULT_CONFIGS, "none, seed 2"}
    assert data["speed"]["2"]["cases"]["none"]["speedup"] == pytest.approx(1.0)
    assert data["speed"]["2"]["cases"]["cspd"]["stats"]["draft_calls"] > 0
    # "cspd" runs the stored settings (this folder stores none: the class defaults), the reference row its config
    assert data["settings"]["2"]["cspd"] == {"stored": True, **CSpDConfig().to_dict()}
    assert data["settings"]["2"]["cspd (reference)"] == {"stored": False,
                                                         **bench_continuous.REFERENCE_CONFIG.to_dict()}
    assert "- cspd (reference): explicit: draft_length=8, prefill_ratio=0.05" in table
    cspd = data["quality"]["cspd"]  # two generation seeds, averaged, with their spread; the chance row one
    assert cspd["seeds"] == 2 and len(cspd["per_seed"]) == 2 and data["quality"]["none, seed 2"]["seeds"] == 1
    assert cspd["geneval"] == pytest.approx(sum(s["geneval"] for s in cspd["per_seed"]) / 2)
    assert " ± " in rows[0] and "over 2 generation seeds" in table
    # sampled images: two seeds differ, and the table shows by how much (the chance row has one seed: no column)
    assert "seed distance |" in table and cspd["seed_distance"] > 0 and "seed_distance" not in data["quality"]["none, seed 2"]


def test_cspd_token_distances_diagnostic():
    """The diagnostic of docs/pipeline_continuous.md: a rejected token's residual sample is a draw of the
    target's own last step (about one last-step standard deviation per channel from its mean)."""
    from mmspec.evaluation.cspd_tokens import recording_verifications, token_distances

    twin = token_distances(make_pipe(tiny_mar(0)), method=CSpDConfig(draft_length=1, prefill_ratio=0.1),
                           class_labels=[1, 3, 4], num_iter=8)
    assert twin["verified_tokens"] > 0 and twin["rejected_tokens"] == 0  # an identical draft: nothing rejected
    assert math.isnan(twin["rejected_residual_to_target_mean_p50"])
    assert twin["accepted_draft_to_target_mean_p90"] < 1e-9  # the twin's tokens are the target's
    assert twin["ratio_log_det_mean"] == 0 and twin["acceptance_probability"] == 1  # identical chains: r = 1
    other = token_distances(make_pipe(tiny_mar(7, depth=1, width=16)),
                            method=CSpDConfig(draft_length=8, prefill_ratio=0.1), class_labels=[1, 3, 4], num_iter=8)
    assert other["rejected_tokens"] > 0
    spread = other["target_last_step_std_x_sqrt_channels_p50"]
    assert 0.3 * spread < other["rejected_residual_to_target_mean_p50"] < 3 * spread
    assert other["rejected_draft_to_target_mean_p50"] > other["rejected_residual_to_target_mean_p50"]
    assert 0 <= other["acceptance_probability"] < 1 and 0 <= other["acceptance_probability_last_step_only"] < 1
    if other["acceptance_probability"] < 1e-6:  # a random draft this far from the target is never accepted
        assert other["rejected_tokens"] == other["verified_tokens"]
    assert other["ratio_log_det_mean"] != 0 and math.isfinite(other["ratio_last_step_p50"])
    from mmspec.methods import cspd

    original = cspd.cspd_verify
    with recording_verifications():
        assert cspd.cspd_verify is not original
    assert cspd.cspd_verify is original  # restored after the block


def test_iteration_order_keeps_whole_iterations_and_equals_chain_with_one_token_each():
    pipe = make_pipe(tiny_mar(7, depth=1, width=16))
    config = CSpDConfig(prefill_ratio=0.1, draft_length=3, verify_context="exact")
    # one token per MAR iteration: the first iteration with a rejection is the first rejected token
    one_each = {order: run(pipe, config.replace(verify_order=order), num_iter=16) for order in ("chain", "iteration")}
    assert torch.equal(one_each["chain"].tokens, one_each["iteration"].tokens)
    # several tokens per iteration: the rejected token's iteration-mates are kept, so rounds commit more
    chain = run(pipe, config.replace(verify_order="chain"), num_iter=6)
    iteration = run(pipe, config.replace(verify_order="iteration"), num_iter=6)
    assert iteration.stats.target_calls < chain.stats.target_calls
    assert torch.isfinite(iteration.tokens).all() and iteration.stats.drafted_tokens > 0
    assert iteration.stats.acceptance_rate < 1.0  # a draft that differs: rejections happened
    with pytest.raises(ValueError, match="verify_order must be one of"):
        config.replace(verify_order="tokens")


@pytest.mark.parametrize("guided", [False, True])
def test_token_conditions_are_the_full_forwards_rows(guided):
    """Each token's condition (rows with unequal token counts, tokens out of row order) equals the full
    forward's row at its position: the forward computes only the sampled positions without mixing them up."""
    model = tiny_mar(0)
    bound = BoundMAR(model, torch.tensor([0, 1, 2]), guided)
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(3, 16, 4, generator=gen, dtype=torch.float64)
    orders = torch.stack([torch.randperm(16, generator=gen) for _ in range(3)])
    rows, context = torch.tensor([2, 0, 1]), torch.tensor([5, 0, 9])
    slot = torch.tensor([1, 0, 1, 2, 1, 0])                 # forward row of each token: 2, 3 and 1 tokens
    grid = torch.tensor([3, 7, 12, 0, 5, 7])
    z, z_u = bound.token_conditions(rows, context, values, orders, slot, grid)
    order = orders[rows]
    visible = torch.zeros(3, 16, dtype=torch.bool).scatter(1, order, torch.arange(16)[None] < context[:, None])
    tokens = torch.zeros(3, 16, 4, dtype=torch.float64).scatter(1, order[..., None].expand(-1, -1, 4), values[rows])
    full = model(tokens, visible, bound.cond[rows])
    assert torch.allclose(z, full[slot, grid], atol=1e-12)
    if guided:
        full_u = model(tokens, visible, bound.uncond[rows])
        assert torch.allclose(z_u, full_u[slot, grid], atol=1e-12)
        assert not torch.allclose(z, z_u)
    else:
        assert z_u is None
