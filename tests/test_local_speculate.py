"""The block-wise local-rejection loop (MuLo-SD's core): bookkeeping, exactness with a perfect drafter,
cache consistency after local resampling, bad input."""

from __future__ import annotations

import pytest
import torch
from stats_utils import P_VALUE_FLOOR, two_sample_chi2_pvalue

from mmspec.local_speculate import RowBlockDrafter, local_speculative_generate
from mmspec.models.llamagen import LlamaGenTransformer
from mmspec.rules import AcceptanceRule, ExactRule, GreedyRule, PoolingThresholdRule
from mmspec.runner import CausalLMRunner, GuidedRunner
from mmspec.sampling import SamplingConfig
from mmspec.speculate import speculative_generate

V, GRID, COND = 24, 4, 5


def tiny_target(seed: int = 0) -> LlamaGenTransformer:
    torch.manual_seed(seed)
    model = LlamaGenTransformer(dim=32, n_layer=2, n_head=4, multiple_of=16, vocab_size=V, block_size=GRID * GRID,
                                model_type="t2i", cls_token_num=COND, caption_dim=16, text_vocab_size=9,
                                condition_rope="identity").double().eval()
    with torch.no_grad():
        model.output.weight.mul_(20.0)
    return model


WORDS = torch.tensor([[-1, 1, 2, 3, 4], [-1, -1, -1, 5, 6], [0, 1, 2, 3, 8]])


def inputs(guided: bool) -> tuple[dict, torch.Tensor]:
    mask = (WORDS >= 0).long()
    if not guided:
        return {"condition_ids": WORDS}, mask
    drop = torch.arange(2 * len(WORDS)) >= len(WORDS)
    return {"condition_ids": torch.cat([WORDS, WORDS]), "condition_drop": drop}, torch.cat([mask, mask])


def target_runner(model, guided: bool):
    runner = CausalLMRunner(model)
    return GuidedRunner(runner, 2.5) if guided else runner


class ScriptedDrafter(RowBlockDrafter):
    """Proposes fixed tokens (e.g. the target's own output, or noise); records what was committed."""

    def __init__(self, tokens: torch.Tensor, block_len: int) -> None:
        self.tokens, self.block_len = tokens, block_len
        self.committed: list[torch.Tensor] = []
        self.prefilled = False

    def prefill(self, attention_mask, **model_inputs) -> None:
        self.prefilled = True

    def propose(self, block_index):
        return self.tokens[:, block_index * self.block_len:(block_index + 1) * self.block_len].clone(), None

    def commit(self, block_index, tokens) -> None:
        self.committed.append(tokens.clone())


def baseline_tokens(model, guided: bool) -> torch.Tensor:
    model_inputs, mask = inputs(guided)
    out = speculative_generate(target_runner(model, guided), None, None, mask, max_new_tokens=GRID * GRID,
                               **model_inputs)
    return out.sequences


def teacher_forced_argmax(model, tokens: torch.Tensor, guided: bool) -> torch.Tensor:
    mask = (WORDS >= 0).long()
    cond = model.forward_train(WORDS, tokens, torch.zeros(len(WORDS), dtype=torch.bool), condition_mask=mask)
    if guided:
        uncond = model.forward_train(WORDS, tokens, torch.ones(len(WORDS), dtype=torch.bool), condition_mask=mask)
        cond = uncond + 2.5 * (cond - uncond)
    return cond.argmax(-1)


@pytest.mark.parametrize("guided", [False, True], ids=["no-cfg", "cfg"])
@pytest.mark.parametrize("block_rows", [1, 2])
def test_a_perfect_drafter_reproduces_target_only_greedy_decoding(guided, block_rows):
    model = tiny_target()
    expected = baseline_tokens(model, guided)
    drafter = ScriptedDrafter(expected, block_rows * GRID)
    model_inputs, mask = inputs(guided)
    out = local_speculative_generate(target_runner(model, guided), drafter, (GRID, GRID), block_rows=block_rows,
                                     radius=1, attention_mask=mask, rule=GreedyRule(), **model_inputs)
    assert torch.equal(out.sequences, expected)
    assert out.drafted.all()
    assert out.stats.target_calls == 1 + GRID // block_rows  # prefill + one pass per block
    assert drafter.prefilled and len(drafter.committed) == GRID // block_rows
    assert torch.equal(torch.cat(drafter.committed, 1), expected)
    assert out.stats.tokens == expected.numel()


@pytest.mark.parametrize("guided", [False, True], ids=["no-cfg", "cfg"])
def test_every_pass_sees_the_final_tokens_of_earlier_blocks(guided):
    """With noise drafts most tokens are redrawn; the first token of each block is verified against
    logits of the *final* previous blocks, so under greedy decoding it equals the teacher-forced argmax
    of the final image. This fails if the re-fed suffix of a block is missing from the target cache."""
    model = tiny_target()
    noise = torch.randint(0, V, (len(WORDS), GRID * GRID), generator=torch.Generator().manual_seed(3))
    model_inputs, mask = inputs(guided)
    out = local_speculative_generate(target_runner(model, guided), ScriptedDrafter(noise, 2 * GRID), (GRID, GRID),
                                     block_rows=2, radius=0, attention_mask=mask, rule=GreedyRule(), **model_inputs)
    with torch.no_grad():
        argmax = teacher_forced_argmax(model, out.sequences, guided)
    starts = list(range(0, GRID * GRID, 2 * GRID))
    assert torch.equal(out.sequences[:, starts], argmax[:, starts])
    assert not out.drafted.all() and (~out.drafted).sum() > 0
    kept = out.drafted
    assert torch.equal(out.sequences[kept], noise[kept])  # kept tokens are the drafts themselves


class RejectOneToken(AcceptanceRule):
    """Accepts every draft except the token id ``bad`` (isolates the neighbourhood logic)."""

    greedy = True

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def masses(self, target_probs, draft_probs, tokens):
        return (tokens != self.bad).to(target_probs.dtype), torch.ones_like(target_probs[..., 0])

    def residual(self, target_probs, draft_probs, tokens):
        return target_probs


def test_radius_grows_rejections_into_square_neighbourhoods():
    model = tiny_target()
    expected = baseline_tokens(model, False)
    bad = int(expected.max()) + 1 if int(expected.max()) + 1 < V else None
    assert bad is not None
    wrong = expected.clone()
    wrong[:, 5] = bad  # one bad draft at row 1, column 1 of every image
    out = local_speculative_generate(CausalLMRunner(model), ScriptedDrafter(wrong, 2 * GRID), (GRID, GRID),
                                     block_rows=2, radius=1, attention_mask=(WORDS >= 0).long(),
                                     rule=RejectOneToken(bad), condition_ids=WORDS)
    redrawn = ~out.drafted.view(-1, GRID, GRID)
    # the bad token's 3x3 neighbourhood inside its block (rows 0-1, columns 0-2) is redrawn, nothing else
    expect = torch.zeros(GRID, GRID, dtype=torch.bool)
    expect[0:2, 0:3] = True
    assert torch.equal(redrawn, expect.expand_as(redrawn))
    assert torch.equal(out.sequences[:, 5], expected[:, 5])  # the target's choice replaced the bad draft


class RejectAll(RejectOneToken):
    """Rejects every draft: the block is resampled entirely."""

    def __init__(self) -> None:
        super().__init__(bad=-1)

    def masses(self, target_probs, draft_probs, tokens):
        return torch.zeros_like(target_probs[..., 0]), torch.ones_like(target_probs[..., 0])


@pytest.mark.parametrize("guided", [False, True], ids=["no-cfg", "cfg"])
@pytest.mark.parametrize("block_rows", [1, 2])
def test_sequential_resampling_of_everything_is_target_only_decoding(guided, block_rows):
    """resample="sequential" draws each redrawn token given the final tokens before it: with every draft
    rejected, greedy output equals target-only greedy decoding exactly; the parallel resampling of the
    same noise drafts does not (each token there saw the noise around it)."""
    model = tiny_target()
    expected = baseline_tokens(model, guided)
    noise = torch.randint(0, V, expected.shape, generator=torch.Generator().manual_seed(5))
    model_inputs, mask = inputs(guided)
    runs = {}
    for mode in ("sequential", "parallel"):
        runs[mode] = local_speculative_generate(
            target_runner(model, guided), ScriptedDrafter(noise, block_rows * GRID), (GRID, GRID),
            block_rows=block_rows, radius=0, attention_mask=mask, rule=RejectAll(), resample=mode, **model_inputs)
    sequential = runs["sequential"]
    assert torch.equal(sequential.sequences, expected)
    assert not sequential.drafted.any()
    # prefill + per block: the verify pass and one call per redrawn column after the first
    assert sequential.stats.target_calls == 1 + (GRID // block_rows) * (block_rows * GRID)
    assert sequential.stats.mean_accepted_length == 1.0  # one token per target call, as target-only decoding
    assert not torch.equal(runs["parallel"].sequences, expected)
    assert runs["parallel"].stats.target_calls == 1 + GRID // block_rows


def test_sequential_resampling_keeps_accepted_drafts_and_redraws_in_context():
    """With one rejected token per image and radius 1, sequential resampling redraws the same 3x3
    neighbourhood as the parallel mode and keeps every other draft; each redrawn token is the target's
    greedy choice given the final tokens before it (checked by teacher forcing the final image)."""
    model = tiny_target()
    expected = baseline_tokens(model, False)
    bad = int(expected.max()) + 1
    wrong = expected.clone()
    wrong[:, 5] = bad
    wrong[:, 4] = (wrong[:, 4] + 1) % bad  # an accepted but wrong neighbour: it must be redrawn in context
    out = local_speculative_generate(CausalLMRunner(model), ScriptedDrafter(wrong, 2 * GRID), (GRID, GRID),
                                     block_rows=2, radius=1, attention_mask=(WORDS >= 0).long(),
                                     rule=RejectOneToken(bad), resample="sequential", condition_ids=WORDS)
    redrawn = ~out.drafted.view(-1, GRID, GRID)
    expect = torch.zeros(GRID, GRID, dtype=torch.bool)
    expect[0:2, 0:3] = True
    assert torch.equal(redrawn, expect.expand_as(redrawn))
    kept = out.drafted
    assert torch.equal(out.sequences[kept], wrong[kept])
    with torch.no_grad():
        argmax = teacher_forced_argmax(model, out.sequences, False)
    assert torch.equal(out.sequences[~kept], argmax[~kept])



class SampledDrafter(RowBlockDrafter):
    """Draws each block from fixed random distributions q (returned with the tokens), so the exact rule's
    ratio and residual with a stochastic draft are exercised."""

    def __init__(self, rows: int, block_len: int, blocks: int, generator: torch.Generator) -> None:
        logits = torch.randn(blocks, block_len, V, generator=generator, dtype=torch.float64) * 2.0
        self.q, self.rows, self.generator = logits.softmax(-1), rows, generator

    def prefill(self, attention_mask, **model_inputs) -> None:
        pass

    def propose(self, block_index):
        q = self.q[block_index].expand(self.rows, -1, -1)
        tokens = torch.multinomial(q.reshape(-1, V), 1, generator=self.generator).view(self.rows, -1)
        return tokens, q

    def commit(self, block_index, tokens) -> None:
        pass


@pytest.mark.parametrize("guided", [False, True], ids=["no-cfg", "cfg"])
@pytest.mark.parametrize("block_rows", [1, 2])
@pytest.mark.parametrize("quality", ["noise", "mixed", "perfect"])
def test_reverify_is_target_only_greedy_decoding_for_any_draft(guided, block_rows, quality):
    """resample="reverify" accepts drafts up to the first rejection, redraws it, and verifies the rest
    of the block again given it: with the exact (greedy) rule every draft quality gives target-only
    decoding's tokens; perfect drafts cost one pass per block, noise about one call per token."""
    model = tiny_target()
    expected = baseline_tokens(model, guided)
    noise = torch.randint(0, V, expected.shape, generator=torch.Generator().manual_seed(5))
    right = torch.rand(expected.shape, generator=torch.Generator().manual_seed(1)) < 0.6
    drafts = {"noise": noise, "mixed": torch.where(right, expected, noise), "perfect": expected}[quality]
    model_inputs, mask = inputs(guided)
    out = local_speculative_generate(target_runner(model, guided), ScriptedDrafter(drafts, block_rows * GRID),
                                     (GRID, GRID), block_rows=block_rows, attention_mask=mask, resample="reverify",
                                     **model_inputs)
    assert torch.equal(out.sequences, expected)
    blocks = GRID // block_rows
    if quality == "perfect":
        assert out.drafted.all() and out.stats.target_calls == 1 + blocks
    else:
        assert 1 + blocks < out.stats.target_calls <= 1 + GRID * GRID
        assert not out.drafted.all()
        assert out.drafted.any() or quality == "noise"
    assert out.stats.emitted == out.sequences.numel()  # every token is emitted once, kept or redrawn


def test_reverify_sampling_follows_the_target_distribution():
    """Exact rule, stochastic drafts from unrelated distributions, 3000 rows of one prompt: tokens 1, 2
    (after a redraw in the same block) and 5 (next block) match target-only sampling (two-sample
    chi-square, p > 1e-4); the paper's parallel resampling of the same drafts fails the same test."""
    model = tiny_target()
    model.output.weight.data.mul_(0.3)  # flatter target: many rejections, many categories
    rows, block_rows = 3000, 1
    words = WORDS[:1].expand(rows, -1)
    mask = (words >= 0).long()
    sampling = SamplingConfig()

    def run(resample: str | None, seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        if resample is None:
            return speculative_generate(CausalLMRunner(model), None, None, mask, max_new_tokens=GRID * GRID,
                                        sampling=sampling, generator=generator, condition_ids=words).sequences
        drafter = SampledDrafter(rows, block_rows * GRID, GRID // block_rows, torch.Generator().manual_seed(seed + 1))
        return local_speculative_generate(CausalLMRunner(model), drafter, (GRID, GRID), block_rows=block_rows,
                                          radius=0, attention_mask=mask, sampling=sampling, rule=ExactRule(),
                                          generator=generator, resample=resample, condition_ids=words).sequences

    baseline, reverify, parallel = run(None, 0), run("reverify", 10), run("parallel", 10)
    for j in (1, 2, 5):
        assert two_sample_chi2_pvalue(reverify[:, j], baseline[:, j]) > P_VALUE_FLOOR, f"token {j}"
    assert max(two_sample_chi2_pvalue(parallel[:, j], baseline[:, j]) for j in (1, 2, 5)) < 1e-10


def test_sampled_decoding_is_deterministic_under_a_generator_and_rules_compose():
    model = tiny_target()
    noise = torch.randint(0, V, (len(WORDS), GRID * GRID), generator=torch.Generator().manual_seed(4))
    neighbors = torch.stack([torch.roll(torch.arange(V), -s) for s in range(1, 4)], 1)
    runs = []
    for rule in (ExactRule(), PoolingThresholdRule(neighbors, k=3, tau=0.2), ExactRule()):
        out = local_speculative_generate(CausalLMRunner(model), ScriptedDrafter(noise, GRID), (GRID, GRID),
                                         block_rows=1, attention_mask=(WORDS >= 0).long(),
                                         sampling=SamplingConfig(), rule=rule,
                                         generator=torch.Generator().manual_seed(0), condition_ids=WORDS)
        assert out.sequences.shape == (len(WORDS), GRID * GRID)
        runs.append(out.sequences)
    assert torch.equal(runs[0], runs[2])


BAD = {
    "rows do not divide": (dict(block_rows=3), "must divide"),
    "negative radius": (dict(block_rows=1, radius=-1), "radius"),
    "bad grid": (dict(block_rows=1, grid=(4,)), "grid"),
    "unknown resampling": (dict(block_rows=1, resample="bogus"), "resample"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments(case):
    kwargs, match = BAD[case]
    grid = kwargs.pop("grid", (GRID, GRID))
    model = tiny_target()
    with pytest.raises(ValueError, match=match):
        local_speculative_generate(CausalLMRunner(model), ScriptedDrafter(torch.zeros(3, 16, dtype=torch.long), 4),
                                   grid, attention_mask=(WORDS >= 0).long(), condition_ids=WORDS, **kwargs)


@pytest.mark.parametrize("tokens,match", [(torch.zeros(3, 5, dtype=torch.long), "rows \\* width"),
                                          (torch.full((3, 16), V, dtype=torch.long), "vocabulary")])
def test_a_drafter_returning_bad_blocks_is_reported(tokens, match):
    model = tiny_target()
    with pytest.raises(ValueError, match=match):
        local_speculative_generate(CausalLMRunner(model), ScriptedDrafter(tokens, 4), (GRID, GRID), block_rows=1,
                                   attention_mask=(WORDS >= 0).long(), condition_ids=WORDS)
