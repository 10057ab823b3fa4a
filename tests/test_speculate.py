"""The speculation loop end to end with tiny transformers Llama models as target and drafter."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from stats_utils import P_VALUE_FLOOR, chi_square_pvalue, empirical

from mmspec import (
    CausalLMRunner,
    JacobiDrafter,
    ModelDrafter,
    SamplingConfig,
    TreeConfig,
    speculative_generate,
)
from mmspec.drafters import draft_chain
from mmspec.lookup_tail import LookupTailDrafter


def _prompt():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    mask[2, :1] = 0
    return ids, mask


DRAFTERS = {
    "chain-self": lambda t, d: ModelDrafter(t, 4),
    "chain-small": lambda t, d: ModelDrafter(d, 3),
    "chain-small-dynamic": lambda t, d: ModelDrafter(d, 6, confidence_threshold=0.5),
    "tree-self": lambda t, d: ModelDrafter(t, tree=TreeConfig(depth=4, top_k=3, total_tokens=30)),
    "tree-small": lambda t, d: ModelDrafter(d, tree=TreeConfig(depth=3, top_k=2, total_tokens=6)),
    "jacobi": lambda t, d: JacobiDrafter(32, window=5),
    # lookup tails: rows' tails end at different lengths (stop at a change), or always run 3 copies
    "chain-small-tail": lambda t, d: LookupTailDrafter(ModelDrafter(d, 2), 4, offset=3, vocab_size=32),
    "chain-self-tail": lambda t, d: LookupTailDrafter(ModelDrafter(t, 3), 3, offset=2, vocab_size=32,
                                                      stop_at_change=False),
}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_speculation_equals_target_only_decoding(llama_pair, name):
    target, draft = llama_pair
    ids, mask = _prompt()
    baseline = speculative_generate(CausalLMRunner(target), None, ids, mask, max_new_tokens=24)
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0,
                                eos_token_id=None)[:, ids.shape[1]:]
    assert torch.equal(baseline.sequences, reference), "baseline loop must match transformers generate"
    spec = speculative_generate(CausalLMRunner(target), DRAFTERS[name](target, draft), ids, mask, max_new_tokens=24)
    assert torch.equal(spec.sequences, baseline.sequences)
    assert baseline.stats.target_calls == 24 and baseline.stats.mean_accepted_length == 1.0
    if name.endswith("self") or name == "chain-self-tail":  # a perfect drafter: every draft accepted, far fewer target calls
        assert spec.stats.target_calls <= 24 // 3 + 2
        assert spec.stats.mean_accepted_length > 3.0
        assert spec.drafted.float().mean() > 0.6
    if name != "jacobi":
        assert spec.stats.draft_calls > 0


@pytest.mark.parametrize("name", ["chain-small", "jacobi"])
def test_one_row_keeps_no_holes_in_the_target_cache(llama_pair, name):
    """A commit keeps max_b(kept_b) slots: with one row the cache holds the prompt and the committed tokens,
    not every slot of every round (rejected drafts left as masked holes made attention and the cache grow)."""
    target, draft = llama_pair
    ids, mask = _prompt()
    runner = CausalLMRunner(target)
    spec = speculative_generate(runner, DRAFTERS[name](target, draft), ids[:1], mask[:1], max_new_tokens=24)
    assert spec.stats.mean_accepted_length < 4  # some drafts were rejected
    assert runner.num_slots == ids.shape[1] + 24 - 1  # the last token is emitted, never fed
    assert bool(runner.slots.valid.all())


def test_eos_stops_rows_independently(llama_pair):
    target, _ = llama_pair
    ids, mask = _prompt()
    free = speculative_generate(CausalLMRunner(target), None, ids, mask, max_new_tokens=12)
    eos = int(free.sequences[0, 3])  # row 0 emits this token 4th
    stopped = speculative_generate(CausalLMRunner(target), ModelDrafter(target, 4), ids, mask, max_new_tokens=12,
                                   eos_token_id=eos, pad_token_id=-7)
    row0 = stopped.sequences[0]
    first = int((free.sequences[0] == eos).nonzero()[0])
    assert stopped.lengths[0] == first + 1
    assert torch.equal(row0[: first + 1], free.sequences[0, : first + 1])
    assert (row0[first + 1:] == -7).all()


def test_streaming_callback_sees_every_token(llama_pair):
    target, draft = llama_pair
    ids, mask = _prompt()
    seen = []
    out = speculative_generate(CausalLMRunner(target), ModelDrafter(target, 3), ids[:1], mask[:1], max_new_tokens=10,
                               callback=lambda tokens, drafted: seen.append(tokens[0][tokens[0] >= 0]))
    assert torch.equal(torch.cat(seen)[:10], out.sequences[0])


def _exact_marginals(target, prompt: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Exact distributions of the first ``steps`` generated tokens by enumerating all prefixes."""
    vocab = target.config.vocab_size
    marginals, prefixes, weights = [], prompt.unsqueeze(0), torch.ones(1, dtype=torch.float64)
    for _ in range(steps):
        with torch.no_grad():
            probs = target(prefixes).logits[:, -1].double().softmax(-1)  # [P, V]
        joint = weights.unsqueeze(1) * probs
        marginals.append(joint.sum(0))
        prefixes = torch.cat([prefixes.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(len(prefixes)).unsqueeze(1)], 1)
        weights = joint.flatten()
    return marginals


@pytest.mark.parametrize("mode", ["chain", "chain-dynamic", "tree", "jacobi-random", "jacobi-left", "jacobi-coupled",
                                  "chain-tail"])
def test_sampling_preserves_the_target_distribution(mode):
    """4000 rows of one prompt, temperature 1: each of the first three tokens follows the exact target
    marginal (chi-square p > 1e-4), with a drafter that disagrees often."""
    vocab = 12
    target = tiny_llama(vocab_size=vocab, layers=2, seed=3)
    draft = tiny_llama(vocab_size=vocab, layers=1, seed=4)
    with torch.no_grad():  # soften both so sampling explores and the drafter is plausible but wrong
        target.lm_head.weight.mul_(0.25)
        draft.lm_head.weight.mul_(0.25)
    prompt = torch.tensor([3, 5, 7, 9])
    rows = 4000
    ids = prompt.expand(rows, -1).contiguous()
    sampling = SamplingConfig(do_sample=True)
    tree = TreeConfig(depth=2, top_k=2, total_tokens=4) if mode == "tree" else None
    if mode.startswith("jacobi"):
        coupled = mode == "jacobi-coupled"  # SCD: random initialisation, coupled redraws
        drafter = JacobiDrafter(vocab, window=3, sampling=sampling, init="random" if coupled else mode.split("-")[1],
                                generator=torch.Generator().manual_seed(1), coupled=coupled)
    else:
        threshold = 0.2 if mode == "chain-dynamic" else 0.0  # the softened drafter is often below it
        drafter = ModelDrafter(draft, 2, sampling=sampling, tree=tree, generator=torch.Generator().manual_seed(1),
                               confidence_threshold=threshold)
    if mode == "chain-tail":  # one sampled draft, then point-mass copies: token 2 is a tail token (token 0's copy)
        drafter = LookupTailDrafter(ModelDrafter(draft, 1, sampling=sampling, generator=torch.Generator().manual_seed(1)),
                                    2, offset=2, vocab_size=vocab, stop_at_change=False)
    out = speculative_generate(CausalLMRunner(target), drafter, ids, max_new_tokens=3, sampling=sampling,
                               generator=torch.Generator().manual_seed(2))
    longest = 4.0 if mode.startswith("jacobi") or mode == "chain-tail" else 3.0  # window 3 / three drafts, or two
    assert 1.02 < out.stats.mean_accepted_length < longest  # drafts are both accepted and rejected
    for j, marginal in enumerate(_exact_marginals(target, prompt, 3)):
        assert chi_square_pvalue(empirical(out.sequences[:, j], vocab), marginal) > P_VALUE_FLOOR, f"token {j}"


def _scripted_step(rows_peaked_until: list[int], vocab: int = 4):
    """A ``step`` for :func:`draft_chain` whose row r is sure of token 1 (prob ~1) for its first
    ``rows_peaked_until[r]`` drafts and undecided (uniform) after; counts its calls."""
    calls = []

    def logits_at(position: int) -> torch.Tensor:
        out = torch.zeros(len(rows_peaked_until), vocab)
        for r, until in enumerate(rows_peaked_until):
            if position < until:
                out[r, 1] = 20.0
        return out

    def step(token: torch.Tensor) -> torch.Tensor:
        calls.append(token)
        return logits_at(len(calls))

    return logits_at(0), step, calls


def test_dynamic_chain_length_stops_once_every_row_is_unsure():
    greedy = SamplingConfig(do_sample=False)
    first, step, calls = _scripted_step([2])
    chain = draft_chain(first, step, 5, greedy, None, confidence_threshold=0.5)
    # drafts 0 and 1 are sure; draft 2 (probability 1/4) is kept, and no forward is spent after it
    assert chain.tokens.shape == (1, 3) and len(calls) == 2
    first, step, calls = _scripted_step([2])
    assert draft_chain(first, step, 5, greedy, None).tokens.shape == (1, 5) and len(calls) == 4  # 0: fixed K
    first, step, calls = _scripted_step([2, 4])  # the batch goes on while any row is sure
    assert draft_chain(first, step, 8, greedy, None, confidence_threshold=0.5).tokens.shape == (2, 5)
    first, step, calls = _scripted_step([9])  # never below the threshold: K drafts
    assert draft_chain(first, step, 4, greedy, None, confidence_threshold=0.9).tokens.shape == (1, 4)


def test_argmax_drafts_under_sampling_are_point_masses_cut_by_the_sampling_distribution():
    """argmax=True draws nothing: the chain is the argmax at every step, returned without distributions;
    the confidence cut reads the sampling distribution (here temperature 3 flattens a margin of 2 nats
    below the threshold that temperature 1 passes)."""
    def logits_at(position: int) -> torch.Tensor:
        return torch.tensor([[0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]])

    def step(token: torch.Tensor) -> torch.Tensor:
        step.calls += 1
        return logits_at(step.calls)

    for temperature, length in ((1.0, 4), (3.0, 1)):
        step.calls = 0
        sampling = SamplingConfig(do_sample=True, temperature=temperature)
        chain = draft_chain(logits_at(0), step, 4, sampling, torch.Generator().manual_seed(0),
                            confidence_threshold=0.5, argmax=True)
        assert chain.probs is None and chain.tokens.tolist() == [[1] * length, [3] * length], temperature
    step.calls = 0
    sampled = draft_chain(logits_at(0), step, 4, SamplingConfig(do_sample=True), torch.Generator().manual_seed(0))
    assert sampled.probs is not None and sampled.probs.shape == (2, 4, 4)


def _scripted_blocks(rows_peaked_until: list[int], block: int, vocab: int = 4):
    """:func:`_scripted_step` for a drafter proposing ``block`` drafts per forward (logits ``[B, block, V]``):
    draft i of the chain is sure of token ``1 + i % 3`` while ``i < rows_peaked_until[r]``."""
    calls = []

    def logits_at(start: int) -> torch.Tensor:
        out = torch.zeros(len(rows_peaked_until), block, vocab)
        for r, until in enumerate(rows_peaked_until):
            for j in range(block):
                if start + j < until:
                    out[r, j, 1 + (start + j) % 3] = 20.0
        return out

    def step(drawn: torch.Tensor) -> torch.Tensor:
        assert drawn.shape == (len(rows_peaked_until), block)  # the whole block is fed back
        calls.append(drawn)
        return logits_at(block * len(calls))

    return logits_at(0), step, calls


def test_block_drafting_draws_k_tokens_per_forward_and_cuts_blocks():
    greedy = SamplingConfig(do_sample=False)
    first, step, calls = _scripted_blocks([99], block=3)
    chain = draft_chain(first, step, 8, greedy, None)  # 3 + 3 + 2 (the last block cut to fit K)
    assert chain.tokens.tolist() == [[1, 2, 3, 1, 2, 3, 1, 2]] and len(calls) == 2
    first, step, calls = _scripted_blocks([4], block=3)
    chain = draft_chain(first, step, 8, greedy, None, confidence_threshold=0.5)
    # drafts 0-3 are sure, draft 4 (in the second block) is the first unsure one: kept, then the chain stops
    assert chain.tokens.shape == (1, 5) and len(calls) == 1
    first, step, calls = _scripted_blocks([1, 5], block=3)  # the batch goes on while any row is sure
    assert draft_chain(first, step, 9, greedy, None, confidence_threshold=0.5).tokens.shape == (2, 6)
    first, step, calls = _scripted_blocks([0], block=3)  # unsure at once: one draft, no second forward
    assert draft_chain(first, step, 9, greedy, None, confidence_threshold=0.5).tokens.shape == (1, 1) and not calls
    sampled = draft_chain(*_scripted_blocks([99, 99], block=3)[:2], 5, SamplingConfig(do_sample=True),
                          torch.Generator().manual_seed(0))
    assert sampled.tokens.shape == (2, 5) and sampled.probs.shape == (2, 5, 4)
    assert torch.allclose(sampled.probs.sum(-1), torch.ones(2, 5, dtype=sampled.probs.dtype))
    assert sampled.tokens.tolist() == [[1, 2, 3, 1, 2]] * 2  # drawn from each draft's own distribution


def test_dynamic_chains_spend_fewer_drafter_forwards_for_the_same_output(llama_pair):
    target, draft = llama_pair
    ids, mask = _prompt()
    fixed = speculative_generate(CausalLMRunner(target), ModelDrafter(draft, 6), ids, mask, max_new_tokens=24)
    dynamic = speculative_generate(CausalLMRunner(target), ModelDrafter(draft, 6, confidence_threshold=0.5), ids,
                                   mask, max_new_tokens=24)
    assert torch.equal(dynamic.sequences, fixed.sequences)
    assert dynamic.stats.draft_calls < fixed.stats.draft_calls


@pytest.mark.parametrize("value", [1.0, -0.1, float("nan"), True, "0.5"])
def test_confidence_threshold_outside_the_unit_interval_is_rejected(llama_pair, value):
    _, draft = llama_pair
    with pytest.raises(ValueError, match="confidence_threshold must be a number in"):
        ModelDrafter(draft, 4, confidence_threshold=value)


def test_confidence_threshold_is_for_chains_not_trees(llama_pair):
    _, draft = llama_pair
    with pytest.raises(ValueError, match="dynamic already"):
        ModelDrafter(draft, tree=TreeConfig(depth=2, top_k=2, total_tokens=4), confidence_threshold=0.3)


def test_vocab_mismatch_is_a_clear_error():
    target = tiny_llama(vocab_size=32)
    draft = tiny_llama(vocab_size=40, layers=1)
    ids, mask = _prompt()
    with pytest.raises(ValueError, match="vocab mismatch"):
        speculative_generate(CausalLMRunner(target), ModelDrafter(draft, 2), ids, mask, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(CausalLMRunner(target), None, ids, mask, max_new_tokens=0)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        ModelDrafter(target, 0)
    with pytest.raises(ValueError, match="vocab mismatch"):
        speculative_generate(CausalLMRunner(target), JacobiDrafter(31), ids, mask, max_new_tokens=4)
    with pytest.raises(ValueError, match="init"):
        JacobiDrafter(32, init="zeros")
    with pytest.raises(ValueError, match="token_range"):
        JacobiDrafter(32, token_range=(10, 40))


def test_classifier_free_guidance_runner_matches_a_manual_guided_loop(llama_pair):
    from mmspec.runner import GuidedRunner
    from mmspec.sampling import apply_guidance

    target, _ = llama_pair
    g = torch.Generator().manual_seed(0)
    cond = torch.randint(3, 32, (2, 5), generator=g)
    prompt = torch.cat([cond, torch.ones_like(cond)])  # [cond; uncond]
    sequence, manual = prompt.clone(), []
    for _ in range(8):
        with torch.no_grad():
            token = apply_guidance(target(sequence).logits[:, -1], 3.0).argmax(-1)
        manual.append(token)
        sequence = torch.cat([sequence, torch.cat([token, token]).unsqueeze(1)], 1)
    baseline = speculative_generate(GuidedRunner(CausalLMRunner(target), 3.0), None, prompt, max_new_tokens=8)
    assert torch.equal(baseline.sequences, torch.stack(manual, 1))
    for drafter in (ModelDrafter(GuidedRunner(CausalLMRunner(target), 3.0), 3),
                    ModelDrafter(GuidedRunner(CausalLMRunner(target), 3.0), tree=TreeConfig(3, 2, 8))):
        spec = speculative_generate(GuidedRunner(CausalLMRunner(target), 3.0), drafter, prompt, max_new_tokens=8)
        assert torch.equal(spec.sequences, baseline.sequences)
        assert spec.stats.target_calls < baseline.stats.target_calls
    with pytest.raises(ValueError, match="2B prompt rows"):
        speculative_generate(GuidedRunner(CausalLMRunner(target), 3.0), None, prompt[:3], max_new_tokens=2)
    # hidden="guided" combines the two halves' features like the logits (h_u + s (h_c - h_u))
    both = GuidedRunner(CausalLMRunner(target, return_hidden=True), 3.0, hidden="both").prefill(prompt)
    guided = GuidedRunner(CausalLMRunner(target, return_hidden=True), 3.0, hidden="guided").prefill(prompt)
    cond, uncond = both.hidden.chunk(2)
    assert torch.allclose(guided.hidden, uncond + 3.0 * (cond - uncond)) and torch.equal(guided.logits, both.logits)
    with pytest.raises(ValueError, match="'cond', 'both' or 'guided'"):
        GuidedRunner(CausalLMRunner(target), 3.0, hidden="mixed")


def test_runner_reads_two_hidden_states_and_only_the_last_prefill_logits(llama_pair):
    """A transformers target is run without output_hidden_states (hooks read the two tensors drafters need)
    and its prefill computes the last slot's logits only (logits_to_keep=1), unless asked for all."""
    from mmspec.hidden_capture import HiddenStateCapture, find_decoder

    target, _ = llama_pair
    seen = []
    handle = target.register_forward_pre_hook(lambda module, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    prompt = torch.randint(3, 32, (2, 7), generator=torch.Generator().manual_seed(1))
    try:
        runner = CausalLMRunner(target, return_hidden=True)
        out = runner.prefill(prompt)
        runner.begin_round()
        step = runner.forward(out.logits[:, -1].argmax(-1, keepdim=True))
    finally:
        handle.remove()
    assert [call["output_hidden_states"] for call in seen] == [False, False]
    assert seen[0]["logits_to_keep"] == 1 and "logits_to_keep" not in seen[1]
    with torch.no_grad():
        reference = target(prompt, output_hidden_states=True)
    assert out.logits.shape == (2, 1, 32) and torch.allclose(out.logits, reference.logits[:, -1:])
    assert torch.allclose(out.hidden, reference.hidden_states[-1])
    assert step.logits.shape == (2, 1, 32) and step.hidden.shape == (2, 1, target.config.hidden_size)
    every = CausalLMRunner(target, prefill_logits="all").prefill(prompt)
    assert every.logits.shape == (2, 7, 32) and torch.allclose(every.logits, reference.logits)
    # the penultimate hook reads the last decoder layer's input, transformers' hidden_states[-2]
    with HiddenStateCapture(find_decoder(target)).recording(top=False, penultimate=True) as grabbed, torch.no_grad():
        target(prompt)
    assert set(grabbed) == {"penultimate"} and torch.allclose(grabbed["penultimate"], reference.hidden_states[-2])
    assert find_decoder(torch.nn.Linear(2, 2)) is None  # not a transformers model: output_hidden_states is used
    with pytest.raises(ValueError, match="prefill_logits must be one of"):
        CausalLMRunner(target, prefill_logits="first")


def _append_reference(tokens, lengths, done, max_new, eos, new_tokens):
    """The buffer's rule spelled out token by token: leading non-negative tokens, up to the row's room,
    up to and including its first EOS; finished rows take nothing."""
    appended = [[-1] * len(row) for row in new_tokens]
    for b, row in enumerate(new_tokens):
        for i, token in enumerate(row):
            if done[b] or token < 0:
                break
            tokens[b].append(token)
            appended[b][i] = token
            lengths[b] += 1
            if lengths[b] >= max_new or token in eos:
                done[b] = True
    return appended


@pytest.mark.parametrize("eos", [[], [3], [3, 5]])
def test_output_buffer_append_matches_the_token_by_token_rule(eos):
    from mmspec.speculate import _OutputBuffer

    g = torch.Generator().manual_seed(0)
    batch, max_new = 5, 9
    buffer = _OutputBuffer(batch, max_new, eos, torch.device("cpu"))
    tokens, lengths, done = [[] for _ in range(batch)], [0] * batch, [False] * batch
    flags = [[] for _ in range(batch)]
    for _ in range(8):
        new = torch.randint(0, 8, (batch, 4), generator=g)
        new[torch.rand(batch, 4, generator=g) < 0.15] = -1  # a -1 ends a row's new tokens
        drafted = torch.randint(0, 5, (batch,), generator=g).tolist()  # each row's first drafted[b] are drafts
        want = _append_reference(tokens, lengths, done, max_new, eos, new.tolist())
        got, got_drafted = buffer.taken_tensors(new, drafted, buffer.append(new, drafted))
        assert got.tolist() == want
        assert torch.equal(got_drafted, (torch.arange(4) < torch.tensor(drafted).unsqueeze(1)) & (got >= 0))
        assert buffer.lengths == lengths and buffer.done == done
        assert buffer.tokens == tokens
        for b in range(batch):
            flags[b].extend(got_drafted[b, got[b] >= 0].tolist())
    sequences, mask = buffer.sequences(pad_token_id=-7), buffer.drafted_mask()
    assert sequences.shape == mask.shape == (batch, max(lengths))
    for b in range(batch):
        assert sequences[b].tolist() == tokens[b] + [-7] * (max(lengths) - lengths[b])
        assert mask[b, :lengths[b]].tolist() == flags[b] and not mask[b, lengths[b]:].any()
    if eos:  # a stop at EOS was exercised
        assert any(done[b] and lengths[b] < max_new for b in range(batch))
    else:  # the room limit was
        assert any(length == max_new for length in lengths)
