"""Rows no token can come from (NaN, infinite, negative, all zero) raise a clear error, not a token.

What is shown: the sampler, the greedy picks, every acceptance rule, chain / tree / fused / local
verification and the speculation loops refuse such rows, naming the step ("target distribution", "draft
distribution", "residual") and the first bad row, also with the value checks off (the decoding loops'
setting) and when the NaN comes from a model's LM head; temperatures and guidance scales that overflow the
logits are refused up front (configs, pipelines, the command line); continuous verification and the MAR
pipeline never turn NaN into a latent.
"""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from conftest import tiny_llama

from mmspec import (
    CausalLMRunner,
    ExactRule,
    GreedyRule,
    GroupedRule,
    LanternRule,
    ModelDrafter,
    PoolingThresholdRule,
    SamplingConfig,
    TreeConfig,
    apply_guidance,
    logits_to_probs,
    sample,
    speculative_generate,
    verify_tokens,
    verify_tree,
)
from mmspec.continuous import cspd_log_ratio_terms, verify_continuous
from mmspec.methods.cspd import CSpDConfig
from mmspec.rules import exact_residual
from mmspec.sampling import draw_uniforms, greedy_tokens, sample_inverse_cdf
from mmspec.tree import DraftTree
from mmspec.validation import NonFiniteProbabilitiesError, NonFiniteValuesError, value_checks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAN, INF = float("nan"), float("inf")
V = 8


def _probs(*shape: int, seed: int = 0) -> torch.Tensor:
    logits = torch.randn(*shape, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return logits.softmax(-1)


def _neighbors(k: int = 3) -> torch.Tensor:
    """Each token's k nearest other tokens on a ring (a stand-in for codebook neighbours)."""
    ids = torch.arange(V)
    return torch.stack([(ids + step) % V for step in range(1, k + 1)], 1)


RULES = {
    "exact": ExactRule(),
    "greedy": GreedyRule(),
    "lantern": LanternRule(_neighbors(), k=3, delta=0.2),
    "lantern-greedy": LanternRule(_neighbors(), k=3, delta=0.2, greedy=True),
    "grouped": GroupedRule(G=3),
    "pooling": PoolingThresholdRule(_neighbors(), k=2, tau=0.3),
}
#: rules whose decisions read the draft distribution (a NaN draft matters to them)
DRAFT_READING = ("exact", "lantern", "grouped")


# ------------------------------------------------------------------------------------------------ the sampler

@pytest.mark.parametrize("value,problem", [(NAN, "contains NaN"), (INF, "infinite"), (-0.5, "negative"),
                                           (0.0, "all zero")])
def test_sample_refuses_a_bad_row_and_names_it(value, problem):
    probs = _probs(2, 3)
    if value == 0.0:
        probs[1, 2] = 0.0
    else:
        probs[1, 2, 4] = value
    with pytest.raises(NonFiniteProbabilitiesError, match=problem) as caught:
        sample(probs, torch.Generator().manual_seed(0))
    assert caught.value.name == "probs" and caught.value.row == (1, 2)
    assert "probs: row [1, 2]" in str(caught.value) and "temperature" in str(caught.value)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("value", [NAN, INF, 0.0])
def test_draws_refuse_bad_rows_with_the_value_checks_off(value):
    probs = _probs(3)
    probs[2] = value
    uniforms = torch.full((3,), 0.5, dtype=probs.dtype)
    with value_checks(False):
        with pytest.raises(NonFiniteProbabilitiesError, match=r"residual: row \[2\]"):
            sample_inverse_cdf(probs, uniforms, "residual")
        with pytest.raises(NonFiniteProbabilitiesError, match=r"target distribution: row \[2\]"):
            greedy_tokens(probs, "target distribution")


def test_draws_of_good_rows_are_unchanged():
    probs = _probs(4, 5)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    uniforms = draw_uniforms(probs.shape[:-1], probs, g2)
    assert torch.equal(sample(probs, g1), sample_inverse_cdf(probs, uniforms))
    assert torch.equal(greedy_tokens(probs), probs.argmax(-1))
    weights = torch.tensor([[0.0, 2.0, 0.0, 2.0]])  # unnormalised weights are fine
    assert sample_inverse_cdf(weights, torch.tensor([0.49])).item() == 1


def test_greedy_logits_with_nan_raise():
    logits = torch.randn(2, 3, V)
    logits[0, 1, 6] = NAN
    with pytest.raises(NonFiniteProbabilitiesError, match=r"logits: row \[0, 1\] contains NaN"):
        logits_to_probs(logits, SamplingConfig(do_sample=False))
    probs = logits_to_probs(logits, SamplingConfig(do_sample=True))  # NaN rows, for the draw to refuse
    assert torch.isnan(probs[0, 1]).all() and torch.isfinite(probs[1]).all()


def test_the_error_survives_pickling():
    original = NonFiniteProbabilitiesError("draft distribution", (0, 3), "contains NaN")
    error = pickle.loads(pickle.dumps(original))
    assert (error.name, error.row, error.problem) == ("draft distribution", (0, 3), "contains NaN")


# ---------------------------------------------------------------------------------------------------- configs

@pytest.mark.parametrize("kwargs,argument", [
    ({"temperature": 1e-45}, "temperature"), ({"temperature": 0.0}, "temperature"),
    ({"temperature": INF}, "temperature"), ({"temperature": NAN}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"do_sample": False, "temperature": NAN}, "temperature"),
    ({"guidance_scale": INF}, "guidance_scale"), ({"guidance_scale": NAN}, "guidance_scale"),
    ({"guidance_scale": 1e300}, "guidance_scale"), ({"guidance_scale": -1.0}, "guidance_scale"),
    ({"top_p": NAN}, "top_p"), ({"top_k": NAN}, "top_k"), ({"top_k": 2.5}, "top_k"),
])
def test_sampling_config_refuses_values_that_overflow(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        SamplingConfig(**kwargs)


def test_sampling_config_accepts_the_bounds():
    SamplingConfig(temperature=0.01, guidance_scale=1000.0)
    SamplingConfig(do_sample=False, temperature=0.0)  # ignored when greedy
    SamplingConfig(top_k=0)


def test_apply_guidance_refuses_an_infinite_scale():
    with pytest.raises(ValueError, match="guidance_scale"):
        apply_guidance(torch.zeros(2, V), INF)


# ---------------------------------------------------------------------------------------------- verification

def _chain(batch: int = 2, k: int = 3):
    probs_q, probs_p = _probs(batch, k, seed=1), _probs(batch, k + 1, seed=2)
    return sample(probs_q, torch.Generator().manual_seed(0)), probs_q, probs_p


@pytest.mark.parametrize("checks", [True, False])
@pytest.mark.parametrize("rule_name", list(RULES))
@pytest.mark.parametrize("deterministic", [True, False])
def test_chain_verification_names_the_targets_bad_row(rule_name, checks, deterministic):
    tokens, q, p = _chain()
    p[1] = NAN  # a model's NaN reaches every later position of its row
    draft = None if deterministic else q
    with value_checks(checks), pytest.raises(NonFiniteProbabilitiesError, match="target distr") as caught:
        verify_tokens(tokens, draft, p, RULES[rule_name], torch.Generator().manual_seed(0))
    assert caught.value.row == (1, 0)


@pytest.mark.parametrize("checks", [True, False])
@pytest.mark.parametrize("rule_name", DRAFT_READING)
def test_chain_verification_names_the_drafts_bad_row(rule_name, checks):
    tokens, q, p = _chain()
    q[0] = NAN
    with value_checks(checks), pytest.raises(NonFiniteProbabilitiesError, match="draft distr") as caught:
        verify_tokens(tokens, q, p, RULES[rule_name], torch.Generator().manual_seed(0))
    assert caught.value.row == (0, 0)


def test_chain_verification_refuses_negative_and_zero_rows_at_the_entry():
    tokens, q, p = _chain()
    p[0, 2, 3] = -0.1
    message = r"target distribution \(target_probs\): row \[0, 2\] contains negative"
    with pytest.raises(NonFiniteProbabilitiesError, match=message):
        verify_tokens(tokens, q, p)
    tokens, q, p = _chain()
    q[1, 1] = 0.0
    with pytest.raises(NonFiniteProbabilitiesError, match=r"draft_probs\): row \[1, 1\] is all zero"):
        verify_tokens(tokens, q, p)


def test_the_fused_kernel_path_refuses_bad_rows(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("MMSPEC_KERNEL_BACKEND", "triton")
    tokens, q, p = _chain()
    p[1] = NAN
    for rule, draft in ((ExactRule(), q), (GreedyRule(), None)):
        with value_checks(False), pytest.raises(NonFiniteProbabilitiesError, match=r"target distr.*\[1, 0\]"):
            verify_tokens(tokens, draft, p, rule, torch.Generator().manual_seed(0))
    tokens, q, p = _chain()
    q[0, 2] = 0.0
    with value_checks(False), pytest.raises(NonFiniteProbabilitiesError, match=r"draft distr.*\[0, 2\]"):
        verify_tokens(tokens, q, p, ExactRule(), torch.Generator().manual_seed(0))


@pytest.mark.parametrize("checks", [True, False])
@pytest.mark.parametrize("rule_name", ["exact", "greedy", "lantern"])
def test_tree_verification_names_the_targets_bad_row(rule_name, checks):
    parents = torch.tensor([[-1, -1, 0, 1]] * 2)
    tree = DraftTree(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]]), parents)
    p = _probs(2, 5)
    p[0] = NAN
    with value_checks(checks), pytest.raises(NonFiniteProbabilitiesError, match="target distr") as caught:
        verify_tree(tree, p, RULES[rule_name], torch.Generator().manual_seed(0))
    assert caught.value.row == (0, 0)


@pytest.mark.parametrize("rule_name", list(RULES))
def test_rules_refuse_bad_rows_and_never_accept_nan(rule_name):
    rule, tokens, q = RULES[rule_name], torch.tensor([2, 5]), _probs(2, seed=4)
    p = _probs(2)
    p[1] = NAN
    for method in (rule.masses, rule.residual, rule.acceptance_probs):
        with pytest.raises(NonFiniteProbabilitiesError, match=r"target distribution \(\w+\): row \[1\]"):
            method(p, q, tokens)
    with value_checks(False):  # the loops' setting: a NaN row fails every acceptance test
        p[1] = NAN
        tokens = torch.tensor([2, int(p[1].argmax())])  # the NaN's index: what an argmax of that row returns
        target_mass, draft_mass = rule.masses(p, q, tokens)
        for u in (0.0, 0.5, 0.999):
            assert not bool((u * draft_mass < target_mass)[1])


def test_an_empty_residual_still_falls_back_to_the_target():
    p = _probs(3)
    assert torch.equal(exact_residual(p, p, torch.tensor([0, 1, 2])), p)
    with pytest.raises(NonFiniteProbabilitiesError, match="draft distribution"):
        exact_residual(p, torch.full_like(p, NAN), torch.tensor([0, 1, 2]))


# --------------------------------------------------------------------------------------- the decoding loops

def _poison(linear: torch.nn.Module) -> None:
    """One NaN weight: every logit of that output unit becomes NaN, and with it each softmax row."""
    with torch.no_grad():
        linear.weight[5, 3] = NAN


class PoisonedAfterPrefill(CausalLMRunner):
    """A target whose LM head (``head``) gets a NaN weight right after the prefill: rounds see NaN logits."""

    def __init__(self, model: torch.nn.Module, head: torch.nn.Module) -> None:
        super().__init__(model)
        self.head = head

    def prefill(self, *args, **kwargs):
        out = super().prefill(*args, **kwargs)
        _poison(self.head)
        return out


def _prompt() -> torch.Tensor:
    return torch.randint(3, 32, (2, 5), generator=torch.Generator().manual_seed(0))


DRAFTERS = {
    "none": lambda draft, sampling: None,
    "chain": lambda draft, sampling: ModelDrafter(draft, 3, sampling=sampling,
                                                  generator=torch.Generator().manual_seed(1)),
    "tree": lambda draft, sampling: ModelDrafter(draft, sampling=sampling,
                                                 tree=TreeConfig(depth=2, top_k=2, total_tokens=4)),
}


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("when", ["from the start", "after the prefill"])
def test_a_nan_lm_head_weight_raises_instead_of_returning_tokens(drafter, do_sample, when):
    target, draft = tiny_llama(layers=1, seed=0), tiny_llama(layers=1, seed=1)
    sampling = SamplingConfig(do_sample=do_sample)
    if when == "from the start":
        _poison(target.lm_head)
        runner = CausalLMRunner(target)
    else:
        runner = PoisonedAfterPrefill(target, target.lm_head)
    with pytest.raises(NonFiniteProbabilitiesError, match="target distribution") as caught:
        speculative_generate(runner, DRAFTERS[drafter](draft, sampling), _prompt(), max_new_tokens=8,
                             sampling=sampling, generator=torch.Generator().manual_seed(0))
    assert caught.value.row[0] == 0  # the first row of the batch (every row is NaN)


def test_a_nan_drafter_is_refused_when_sampling_and_cannot_change_greedy_output():
    target, draft = tiny_llama(layers=1, seed=0), tiny_llama(layers=1, seed=1)
    _poison(draft.lm_head)
    greedy = SamplingConfig(do_sample=False)
    baseline = speculative_generate(CausalLMRunner(target), None, _prompt(), max_new_tokens=8,
                                    sampling=greedy)
    spec = speculative_generate(CausalLMRunner(target), ModelDrafter(draft, 3, sampling=greedy), _prompt(),
                                max_new_tokens=8, sampling=greedy)
    assert torch.equal(spec.sequences, baseline.sequences)  # NaN drafts are verified away, the target decides
    sampling = SamplingConfig(do_sample=True)
    with pytest.raises(NonFiniteProbabilitiesError):
        speculative_generate(CausalLMRunner(target), DRAFTERS["chain"](draft, sampling), _prompt(),
                             max_new_tokens=8, sampling=sampling, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("resample,do_sample", [("parallel", True), ("sequential", False),
                                               ("reverify", True)])
def test_local_speculation_refuses_a_nan_target(resample, do_sample):
    from test_local_speculate import GRID, ScriptedDrafter, inputs, tiny_target

    from mmspec.local_speculate import local_speculative_generate

    model = tiny_target()
    model_inputs, mask = inputs(guided=False)
    drafts = torch.randint(0, 24, (mask.shape[0], GRID * GRID), generator=torch.Generator().manual_seed(0))
    runner = PoisonedAfterPrefill(model, model.output)
    with pytest.raises(NonFiniteProbabilitiesError, match="target distribution"):
        local_speculative_generate(runner, ScriptedDrafter(drafts, 2 * GRID), (GRID, GRID), block_rows=2,
                                   attention_mask=mask, sampling=SamplingConfig(do_sample=do_sample),
                                   resample=resample, generator=torch.Generator().manual_seed(0),
                                   **model_inputs)


# ------------------------------------------------------------------------------ pipelines and command line

def test_the_command_line_refuses_an_infinite_guidance_scale(capsys):
    from mmspec.cli import main as cli_main

    with pytest.raises(SystemExit) as caught:
        cli_main(["generate", "a red circle", "--pipeline", "nowhere", "--guidance-scale", "inf"])
    assert caught.value.code not in (0, None)
    error = capsys.readouterr().err
    assert "--guidance-scale" in error and "finite" in error


def test_the_image_pipeline_refuses_overflowing_settings_before_any_work(monkeypatch):
    from tiny_shapes_pipeline import tiny_shapes_pipeline

    pipe = tiny_shapes_pipeline()

    def forbidden(*args, **kwargs):
        raise AssertionError("the transformer ran before the inputs were checked")
    monkeypatch.setattr(pipe.transformer, "forward", forbidden)
    cases = (({"guidance_scale": INF}, "guidance_scale"), ({"guidance_scale": NAN}, "guidance_scale"),
             ({"temperature": 1e-45}, "temperature"), ({"temperature": INF}, "temperature"))
    for kwargs, argument in cases:
        with pytest.raises(ValueError, match=argument):
            pipe("a red circle", method="none", output_type="tokens", **kwargs)


@pytest.mark.parametrize("kwargs,argument", [
    ({"temperature": INF}, "temperature"), ({"temperature": NAN}, "temperature"),
    ({"temperature": 1e-45}, "temperature"), ({"guidance_scale": INF}, "guidance_scale"),
    ({"method": lambda: CSpDConfig(density_temperature=INF)}, "density_temperature"),
])
def test_the_continuous_pipeline_refuses_overflowing_settings(kwargs, argument):
    from test_continuous_pipeline import make_pipe, run, tiny_mar

    with pytest.raises(ValueError, match=argument):  # a method's config refuses its own settings when built
        run(make_pipe(tiny_mar(1)), **{k: v() if callable(v) else v for k, v in kwargs.items()})


def test_the_continuous_pipeline_never_returns_nan_latents():
    from test_continuous_pipeline import make_pipe, run

    pipe = make_pipe(None)
    with torch.no_grad():
        next(pipe.transformer.head.parameters()).view(-1)[0] = NAN
    with pytest.raises(NonFiniteValuesError, match="latents"):
        run(pipe)


# ---------------------------------------------------------------------------------- continuous verification

def test_continuous_verification_refuses_nan():
    normal = torch.distributions.Normal
    draft, target = normal(torch.zeros(3), torch.ones(3)), normal(torch.zeros(3), torch.ones(3))
    samples = torch.tensor([0.1, NAN, 0.3])
    with pytest.raises(NonFiniteValuesError, match=r"samples .* index \[1\]"):
        verify_continuous(draft, target, samples)
    bad_target = normal(torch.tensor([0.0, 0.0, NAN]), torch.ones(3), validate_args=False)
    with pytest.raises(NonFiniteValuesError, match=r"target log density .* index \[2\]"):
        verify_continuous(draft, bad_target, torch.zeros(3))
    far = torch.full((3,), 4.0)  # unlikely under the target: the drafts are rejected and residuals drawn
    with pytest.raises(NonFiniteValuesError, match="residual proposal"):
        verify_continuous(normal(far, torch.ones(3)), NaNSampler(), far, torch.Generator().manual_seed(0))


class NaNSampler:
    """A standard normal density whose sampler returns NaN (an overflowed diffusion head, say)."""

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        return torch.distributions.Normal(0.0, 1.0).log_prob(x.nan_to_num(0.0))

    def sample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        return torch.full((*sample_shape, 3), NAN)


def test_cspd_log_ratio_refuses_nan_means_and_variances():
    shape = (3, 2, 4)
    means, variances = torch.zeros(shape), torch.ones(shape)
    bad = variances.clone()
    bad[1, 0, 2] = NAN
    with pytest.raises(NonFiniteValuesError, match=r"draft_vars .* index \[1, 0, 2\]"):
        cspd_log_ratio_terms(torch.zeros(2, 4), means, variances, means, bad)
    with pytest.raises(ValueError, match="positive"):
        cspd_log_ratio_terms(torch.zeros(2, 4), means, -variances, means, variances)
    assert math.isfinite(float(sum(t.sum() for t in cspd_log_ratio_terms(torch.zeros(2, 4), means, variances,
                                                                         means, variances))))
