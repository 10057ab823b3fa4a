"""The CSpD switches that reproduce the released code do reproduce it.

mmspec's CSpD verification (:func:`mmspec.continuous.cspd_verify`, settings in ``CSpDConfig``) is compared
with a re-derivation of the released verification written from reading it (the docstrings below cite
repository, file, class, function and commit), on random diagonal Gaussians: token dimensions 1, 4 and 16,
12 tokens per call, denoising chains of 1-8 steps, the plain and the released inner temperature (1 and 42).
With the released settings and the same random numbers (one uniform per token, then per try one normal
vector and one uniform per token, drawn in the same order and precision), decisions and outputs are
identical; each switch alone is shown to matter (the default differs from the released code on the same
inputs), and the default path is covered by tests/test_continuous.py and tests/test_continuous_pipeline.py.

Released code read: github.com/MarkXCloud/CSpD at commit d91f721ab15307df17215d21f31ddb9159add238
(spec_decode/spec_decode_runner.py, class DistributionProcessor; diffusion/gaussian_diffusion.py,
p_sample_with_noise and p_sample_loop_progressive_with_noise, for what its means, "vars" and "log_var" hold).
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats as sps

from mmspec.continuous import cspd_log_ratio_terms, cspd_verify
from mmspec.methods import cspd
from mmspec.methods.cspd import CSpDConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

F64 = torch.float64
DIMS = (1, 4, 16)
STEPS = tuple(range(1, 9))
RELEASED_TRIES = 100
#: mmspec's settings that reproduce the released verification (besides density_temperature).
RELEASED = dict(logdet_term="sigma_ratio_product", temper_residual=False, residual_loop="whole_batch_last_accepted",
                exhausted_residual="zero")


# ----------------------------------------------------------------------------------------------------
# Re-derivation of the released verification
# ----------------------------------------------------------------------------------------------------

def released_inputs(means: torch.Tensor, stds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the released runner hands DistributionProcessor for one chain (gaussian_diffusion.py,
    p_sample_loop_progressive_with_noise: at the last step (i == 0) the manager keeps ``means`` and
    ``vars`` (the standard deviation, times the sampling temperature); every earlier step adds its
    ``0.5 * log_variance``, a log standard deviation, to ``log_var``).
    Returns (last-step mean, last-step std, summed log std of the earlier steps), each ``[N, C]``."""
    return means[-1], stds[-1], stds[:-1].log().sum(0)


def released_log_acceptance(x, d_mean, d_std, d_log_std, t_mean, t_std, t_log_std, inner_temperature):
    """spec_decode_runner.py, DistributionProcessor.judge_accept (with __init__'s fixed_term): the target's and
    draft's unnormalised Gaussians with the std multiplied by the inner temperature, times fixed_term =
    exp(sum(target log std - draft log std)) = prod sigma_p / sigma_q over the earlier steps, times
    prod(draft std) / prod(target std) of the last step. Returned as a log (the released code exponentiates)."""
    def log_unnormalised(mean, std):
        return -0.5 * (((x - mean) / std / inner_temperature) ** 2).sum(-1)
    log_fixed = (t_log_std - d_log_std).sum(-1)
    return (log_unnormalised(t_mean, t_std) + log_fixed + d_std.log().sum(-1)
            - log_unnormalised(d_mean, d_std) - t_std.log().sum(-1))


def released_speculative_sample(x, d_mean, d_std, d_log_std, t_mean, t_std, t_log_std, inner_temperature,
                                generator, tries=RELEASED_TRIES):
    """spec_decode_runner.py, DistributionProcessor.speculative_sample and sample_distribution.

    Accept token i when judge_accept(x_i) > u_i. Unless all are accepted, the residual loop runs over every
    token (accepted ones included): up to ``tries`` (released: 100) times, a proposal y ~ N(t_mean, t_std^2)
    (no inner temperature) passes where eps < max(0, p(y) - q(y) / fixed_term) / p(y), with p, q the plain
    normalised last-step Gaussians; a passing proposal overwrites the token's sample (which starts as zeros);
    the loop stops once every token has passed at least once. Rejected tokens take their sample.
    Returns (accepted [N], output [N, C])."""
    n, dim = x.shape
    ratio = released_log_acceptance(x, d_mean, d_std, d_log_std, t_mean, t_std, t_log_std, inner_temperature).exp()
    accepted = ratio > torch.rand(n, generator=generator, dtype=F64)
    if bool(accepted.all()):
        return accepted, x.clone()
    fixed = (t_log_std - d_log_std).sum(-1).exp()

    def pdf(y, mean, std):
        return torch.exp(-0.5 * (((y - mean) / std) ** 2).sum(-1)) / ((2 * math.pi) ** (dim / 2) * std.prod(-1))

    sample = torch.zeros_like(t_mean)
    passed_once = torch.zeros(n, dtype=torch.bool)
    for _ in range(tries):
        proposal = torch.randn(n, dim, generator=generator, dtype=F64) * t_std + t_mean
        p_y = pdf(proposal, t_mean, t_std)
        alpha = (p_y - pdf(proposal, d_mean, d_std) / fixed).clamp(min=0) / p_y
        passed = torch.rand(n, generator=generator, dtype=F64) < alpha
        sample[passed] = proposal[passed]
        passed_once |= passed
        if bool(passed_once.all()):
            break
    return accepted, torch.where(accepted.unsqueeze(-1), x, sample)


# ----------------------------------------------------------------------------------------------------
# Random chains
# ----------------------------------------------------------------------------------------------------

def random_chains(seed: int, steps: int, dim: int, n: int = 12, spread: float = 0.3):
    """Draft and target chains of ``steps`` diagonal Gaussians ``[T, N, C]`` (means, stds) whose stds differ by
    up to exp(+-spread) per step, and a draft token per row drawn from the draft's last step."""
    gen = torch.Generator().manual_seed(seed)
    t_means = 0.5 * torch.randn(steps, n, dim, generator=gen, dtype=F64)
    d_means = t_means + 0.4 * torch.randn(steps, n, dim, generator=gen, dtype=F64) / math.sqrt(dim)
    t_stds = 0.5 * torch.exp(spread * torch.randn(steps, n, dim, generator=gen, dtype=F64))
    d_stds = t_stds * torch.exp(spread * torch.randn(steps, n, dim, generator=gen, dtype=F64) / math.sqrt(dim))
    x = d_means[-1] + d_stds[-1] * torch.randn(n, dim, generator=gen, dtype=F64)
    return x, d_means, d_stds, t_means, t_stds


def run_both(seed, steps, dim, inner_temperature, tries=RELEASED_TRIES, spread=0.3, **settings):
    """mmspec's cspd_verify (with ``settings``) and the re-derivation on the same chains and random numbers."""
    x, d_means, d_stds, t_means, t_stds = random_chains(seed, steps, dim, spread=spread)
    ours = cspd_verify(x, d_means, d_stds ** 2, t_means, t_stds ** 2, torch.Generator().manual_seed(seed + 1),
                       density_temperature=inner_temperature, max_tries=tries, **settings)
    theirs = released_speculative_sample(x, *released_inputs(d_means, d_stds), *released_inputs(t_means, t_stds),
                                         inner_temperature, torch.Generator().manual_seed(seed + 1), tries=tries)
    return ours, theirs


# ----------------------------------------------------------------------------------------------------
# The released settings reproduce the released code
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("inner_temperature", [1.0, 42.0])
def test_released_settings_reproduce_the_released_verification(dim, inner_temperature):
    outcomes = {"accepted": 0, "rejected": 0, "zeros": 0}
    for steps in STEPS:
        for seed in range(4):
            ours, (accepted, output) = run_both(100 * steps + seed, steps, dim, inner_temperature, **RELEASED)
            assert torch.equal(ours.accepted, accepted), (steps, seed)
            assert torch.equal(ours.samples, output), (steps, seed)
            outcomes["accepted"] += int(accepted.sum())
            outcomes["rejected"] += int((~accepted).sum())
            outcomes["zeros"] += int((output == 0).all(-1).sum())
    # the comparison covered both decisions (the released zero-vector fallback is exercised below)
    assert outcomes["accepted"] > 0 and outcomes["rejected"] > 0


@pytest.mark.parametrize("steps", [1, 3, 8])
def test_released_settings_reproduce_the_zero_vector_after_the_last_try(steps):
    """Nearly equal chains: the residual max(0, p - q) is tiny, so with few tries some rejected tokens never
    get a proposal; the released code leaves them zero, and so does ``exhausted_residual="zero"``."""
    zeros = 0
    for seed in range(6):
        ours, (accepted, output) = run_both(seed, steps, 4, 1.0, tries=3, spread=0.02, **RELEASED)
        assert torch.equal(ours.accepted, accepted) and torch.equal(ours.samples, output)
        exhausted = (output == 0).all(-1) & ~accepted
        assert ours.num_fallbacks == int(exhausted.sum())
        zeros += int(exhausted.sum())
    assert zeros > 0
    # the default keeps the last target draw instead: no zero vectors, the same decisions
    ours_default, (accepted, _) = run_both(0, steps, 4, 1.0, tries=3, spread=0.02,
                                           **{**RELEASED, "exhausted_residual": "last_target_draw"})
    assert torch.equal(ours_default.accepted, accepted)
    assert not bool((ours_default.samples == 0).all(-1).any())


# ----------------------------------------------------------------------------------------------------
# Each switch matters on its own
# ----------------------------------------------------------------------------------------------------

def test_two_step_example_ratio_two_versus_one_half():
    """Two steps, one dimension, the draft's first step twice as wide as the target's, equal last steps: the
    trajectory densities give ratio sigma_q / sigma_p = 2; the released code's fixed_term gives 1/2."""
    x0 = torch.zeros(1, 1, dtype=F64)
    means = torch.zeros(2, 1, 1, dtype=F64)
    target_vars = torch.ones(2, 1, 1, dtype=F64)
    draft_vars = torch.tensor([4.0, 1.0], dtype=F64).reshape(2, 1, 1)
    for term, expected in (("gaussian_normalisers", 2.0), ("sigma_ratio_product", 0.5)):
        log_det, last_step = cspd_log_ratio_terms(x0, means, target_vars, means, draft_vars, logdet_term=term)
        assert float((log_det + last_step).exp()) == pytest.approx(expected)
    stds = draft_vars.sqrt()
    released = released_log_acceptance(x0, *released_inputs(means, stds), *released_inputs(means, target_vars.sqrt()),
                                       1.0)
    assert float(released.exp()) == pytest.approx(0.5)


@pytest.mark.parametrize("dim", DIMS)
def test_log_ratio_switch_matches_the_released_judge_accept(dim):
    for steps in STEPS:
        x, d_means, d_stds, t_means, t_stds = random_chains(steps, steps, dim)
        released = released_log_acceptance(x, *released_inputs(d_means, d_stds), *released_inputs(t_means, t_stds),
                                           42.0)
        ours = cspd_verify(x, d_means, d_stds ** 2, t_means, t_stds ** 2, torch.Generator().manual_seed(0),
                           density_temperature=42.0, max_tries=1, logdet_term="sigma_ratio_product").log_ratio
        assert torch.allclose(ours, released, rtol=1e-10, atol=1e-10)
        default = cspd_verify(x, d_means, d_stds ** 2, t_means, t_stds ** 2, torch.Generator().manual_seed(0),
                              density_temperature=42.0, max_tries=1).log_ratio
        if steps > 1:  # the earlier steps' term flips sign
            assert not torch.allclose(default, released, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("switch,default", [("logdet_term", "gaussian_normalisers"), ("temper_residual", True),
                                            ("residual_loop", "first_accepted")])
def test_each_switch_changes_the_outcome_on_the_same_random_numbers(switch, default):
    """With one switch back at its default (the others released), some outputs differ from the released code's
    on the same random numbers (the inner temperature 42 makes the tempered residual differ)."""
    differs = False
    for steps in (2, 5, 8):
        for seed in range(4):
            ours, (accepted, output) = run_both(100 * steps + seed, steps, 4, 42.0, **{**RELEASED, switch: default})
            differs |= not (torch.equal(ours.accepted, accepted) and torch.equal(ours.samples, output))
    assert differs


def test_both_residual_loops_draw_the_same_residual_distribution():
    """1-D: draft N(0.8, 0.7^2), target N(0, 1): the residual samples of either loop follow
    norm(max(0, p - q)) (two-sample KS test at p > 1e-3 on about 9000 rejected tokens each)."""
    n = 30000
    gen = torch.Generator().manual_seed(5)
    d_means, d_vars = torch.full((1, n, 1), 0.8, dtype=F64), torch.full((1, n, 1), 0.49, dtype=F64)
    t_means, t_vars = torch.zeros(1, n, 1, dtype=F64), torch.ones(1, n, 1, dtype=F64)
    x = 0.8 + 0.7 * torch.randn(n, 1, generator=gen, dtype=F64)
    residuals = {}
    for loop in ("first_accepted", "whole_batch_last_accepted"):
        result = cspd_verify(x, d_means, d_vars, t_means, t_vars, torch.Generator().manual_seed(6), max_tries=400,
                             residual_loop=loop)
        assert result.num_fallbacks == 0
        residuals[loop] = result.samples[~result.accepted].squeeze(1).numpy()
    first, last = residuals.values()
    assert min(first.size, last.size) > 5000
    assert sps.ks_2samp(first, last).pvalue > 1e-3
    # power: the residual is not the target itself
    assert sps.kstest(first, "norm").pvalue < 1e-6


# ----------------------------------------------------------------------------------------------------
# The config: validation and how the settings reach the verification
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("logdet_term", "sigma"), ("temper_residual", 1),
                                         ("residual_loop", "official"), ("exhausted_residual", None)])
def test_config_rejects_bad_switch_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        CSpDConfig(**{field: value})


def test_defaults_are_the_paper_and_mmspec_behaviour():
    config = CSpDConfig()
    assert (config.logdet_term, config.temper_residual, config.residual_loop, config.exhausted_residual) == (
        "gaussian_normalisers", True, "first_accepted", "last_target_draw")


def test_verification_functions_reject_bad_switch_values_naming_the_argument():
    x, d_means, d_stds, t_means, t_stds = random_chains(0, 2, 4)
    for name, value in (("logdet_term", "x"), ("residual_loop", "x"), ("exhausted_residual", "x"),
                        ("temper_residual", "no")):
        with pytest.raises(ValueError, match=name):
            cspd_verify(x, d_means, d_stds ** 2, t_means, t_stds ** 2, **{name: value})


def test_config_switches_reach_the_verification(monkeypatch):
    from test_continuous_pipeline import make_pipe, run, tiny_mar

    seen = []
    original = cspd.cspd_verify

    def recording(*args, **kwargs):
        seen.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(cspd, "cspd_verify", recording)
    pipe = make_pipe(tiny_mar(7, depth=1, width=16))
    out = run(pipe, CSpDConfig(prefill_ratio=0.0, draft_length=2, density_temperature=42.0, max_tries=5, **RELEASED),
              class_labels=[1], num_iter=4)
    assert seen and all({key: kwargs[key] for key in RELEASED} == RELEASED for kwargs in seen)
    assert out.stats.drafted_tokens > 0
