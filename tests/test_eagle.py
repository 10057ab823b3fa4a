"""EAGLE draft head: lossless drafting through the core loop, training objective, bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from mmspec import CausalLMRunner, SamplingConfig, TreeConfig, speculative_generate
from mmspec.models.eagle import EagleDrafter, EagleHead
from mmspec.models.recipes.eagle_loss import eagle_loss, rollout_features


def _head(target, dtype=torch.float64, **kwargs) -> EagleHead:
    torch.manual_seed(0)
    head = EagleHead(hidden_size=target.config.hidden_size, vocab_size=target.config.vocab_size,
                     num_attention_heads=4, **kwargs).to(dtype)
    return head.bind_target(target.get_input_embeddings(), target.get_output_embeddings())


@pytest.mark.parametrize("tree,num_future,threshold", [(None, 1, 0.0), (TreeConfig(depth=3, top_k=2, total_tokens=6), 1, 0.0),
                                                        (None, 3, 0.0), (None, 3, 0.05)],
                         ids=["chain", "tree", "blocks-of-3", "blocks-of-3-dynamic"])
def test_untrained_head_is_lossless_under_greedy(llama_pair, tree, num_future, threshold):
    target, _ = llama_pair
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    baseline = speculative_generate(CausalLMRunner(target), None, ids, mask, max_new_tokens=16)
    drafter = EagleDrafter(_head(target, input_norm=True, num_future=num_future), 7, tree=tree,
                           confidence_threshold=threshold)
    spec = speculative_generate(CausalLMRunner(target, return_hidden=True), drafter, ids, mask, max_new_tokens=16)
    assert torch.equal(spec.sequences, baseline.sequences)
    assert spec.stats.draft_calls > 0
    if num_future > 1 and not threshold:  # chains of 7 in blocks of 3: 3 head forwards per round, not 7
        rounds = spec.stats.target_calls - 1
        assert spec.stats.draft_calls <= 3 * rounds + 1


def test_block_head_shapes_tree_and_rollout_errors(llama_pair):
    target, _ = llama_pair
    head = _head(target, num_future=3)
    ids, hidden = torch.randint(3, 32, (2, 5)), torch.randn(2, 5, 32, dtype=torch.float64)
    out = head(ids, target_hidden=hidden, use_cache=False)
    assert out.logits.shape == (2, 5, 3, 32) and out.hidden_states[0].shape == (2, 5, 3, 32)
    with pytest.raises(NotImplementedError, match="trees are not implemented"):
        EagleDrafter(head, tree=TreeConfig(depth=2, top_k=2, total_tokens=4))
    with pytest.raises(ValueError, match="num_future > 1"):
        eagle_loss(head, ids, hidden, rollout_steps=2)
    with pytest.raises(ValueError, match="num_future"):
        EagleHead(hidden_size=32, vocab_size=32, num_future=0)


def test_block_head_loss_compares_future_k_with_the_feature_k_slots_later():
    """Future k of the pair at slot j is trained on the target's feature at slot j + k (a hand-computed loss)."""
    target, head, ids, hidden, _ = _random_pairs(4, 2, 7, num_future=3)
    out = eagle_loss(head, ids, hidden)
    futures = head(ids[:, 1:], target_hidden=hidden[:, :-1], use_cache=False).hidden_states[0]  # [B, 6, 3, d]
    lm_head = target.get_output_embeddings()
    total = 0.0
    for k in range(3):
        predicted, wanted = futures[:, : 6 - k, k], hidden[:, 1 + k:]
        feature = torch.nn.functional.smooth_l1_loss(predicted, wanted)
        ce = -(lm_head(wanted).softmax(-1) * lm_head(predicted).log_softmax(-1)).sum(-1).mean()
        total = total + feature + 0.1 * ce
        agree = (lm_head(predicted).argmax(-1) == lm_head(wanted).argmax(-1)).double().mean()
        assert torch.allclose(out[f"top1_future{k + 1}"], agree)
    assert torch.allclose(out["loss"], total / 3, atol=1e-10)
    assert torch.equal(out["top1"], out["top1_future1"])


def test_block_head_training_raises_acceptance_with_fewer_head_forwards(trained_pair):
    """A head with 3 futures, started from the trained plain head (readout = identity) and trained on the
    same samples: fewer head forwards than the plain head for its chains, drafts accepted, still lossless."""
    target, plain, log = trained_pair
    head = _head(target, dtype=torch.float32, num_future=3)
    head.load_state_dict({**plain.state_dict(), **{k: v for k, v in head.state_dict().items() if "future" in k}})
    head.future.start_as_identity()
    with torch.no_grad():  # the identity start: every future is the plain head's prediction
        ids, hidden = log["ids"], torch.randn(4, 4, 32)
        assert torch.allclose(head(ids, target_hidden=hidden, use_cache=False).hidden_states[0][:, :, 2],
                              plain(ids, target_hidden=hidden, use_cache=False).hidden_states[0], atol=1e-6)
    losses = _train_on_own_samples(target, head, 80, torch.Generator().manual_seed(5))
    assert sum(losses[-10:]) < 0.95 * sum(losses[:10])  # from a trained start: the later futures learn
    ids = log["ids"]
    baseline = speculative_generate(CausalLMRunner(target), None, ids, max_new_tokens=16)
    runs = {}
    for name, model in (("plain", plain), ("blocks", head)):
        runs[name] = speculative_generate(CausalLMRunner(target, return_hidden=True), EagleDrafter(model, 6), ids,
                                          max_new_tokens=16)
        assert torch.equal(runs[name].sequences, baseline.sequences)
    assert runs["blocks"].stats.mean_accepted_length > log["before"] + 0.1
    per_round = {name: run.stats.draft_calls / (run.stats.target_calls - 1) for name, run in runs.items()}
    assert per_round["blocks"] < 0.5 * per_round["plain"], per_round


def _train_on_own_samples(target, head, steps: int, g: torch.Generator) -> list[float]:
    """EAGLE training steps on the target's own samples; returns the losses."""
    prompts = torch.randint(3, 32, (64, 4), generator=g)
    samples = speculative_generate(CausalLMRunner(target), None, prompts, max_new_tokens=16,
                                   sampling=SamplingConfig(do_sample=True), generator=g).sequences
    sequences = torch.cat([prompts, samples], 1)
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        batch = sequences[torch.randint(0, 64, (32,), generator=g)]
        with torch.no_grad():
            hidden = target(batch, output_hidden_states=True).hidden_states[-1]
        out = eagle_loss(head, batch, hidden, feature_noise=0.1, generator=g)
        optimizer.zero_grad()
        out["loss"].backward()
        optimizer.step()
        losses.append(out["loss"].item())
    return losses


@pytest.fixture(scope="module")
def trained_pair():
    """(target, head): a float32 tiny target and a head trained 80 steps on its samples."""
    torch.manual_seed(0)
    target = tiny_llama(layers=2, seed=0, dtype=torch.float32)
    target.requires_grad_(False)
    head = _head(target, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32, (4, 4), generator=g)
    before = speculative_generate(CausalLMRunner(target, return_hidden=True), EagleDrafter(head, 4), ids,
                                  max_new_tokens=16).stats.mean_accepted_length
    losses = _train_on_own_samples(target, head, 80, g)
    head.requires_grad_(False)
    return target, head, {"losses": losses, "ids": ids, "before": before}


def test_training_raises_acceptance_and_stays_lossless(trained_pair):
    """A few dozen EAGLE steps on the target's own samples: loss falls, drafts get accepted."""
    target, head, log = trained_pair
    losses, ids = log["losses"], log["ids"]
    assert sum(losses[-10:]) < 0.8 * sum(losses[:10])
    baseline = speculative_generate(CausalLMRunner(target), None, ids, max_new_tokens=16)
    spec = speculative_generate(CausalLMRunner(target, return_hidden=True), EagleDrafter(head, 4), ids, max_new_tokens=16)
    assert torch.equal(spec.sequences, baseline.sequences)
    assert spec.stats.mean_accepted_length > log["before"] + 0.1


def test_save_load_roundtrip_does_not_store_the_target_head(tmp_path, llama_pair):
    target, _ = llama_pair
    head = _head(target)
    head.save_pretrained(tmp_path)
    loaded = EagleHead.from_pretrained(tmp_path).to(torch.float64)
    assert not any("lm_head" in k or "embed" in k for k in loaded.state_dict())
    loaded.bind_target(target.get_input_embeddings(), target.get_output_embeddings())
    ids = torch.randint(3, 32, (2, 5))
    hidden = torch.randn(2, 5, 32, dtype=torch.float64)
    assert torch.allclose(loaded(ids, target_hidden=hidden, use_cache=False).logits,
                          head(ids, target_hidden=hidden, use_cache=False).logits)


def test_mismatched_head_is_a_clear_error(llama_pair):
    target, _ = llama_pair
    with pytest.raises(ValueError, match="vocab mismatch"):
        EagleHead(hidden_size=32, vocab_size=40).bind_target(target.get_input_embeddings(), target.get_output_embeddings())
    with pytest.raises(RuntimeError, match="bind_target"):
        EagleDrafter(EagleHead(hidden_size=32, vocab_size=32))
    ids = torch.randint(3, 32, (1, 5))
    with pytest.raises(ValueError, match="return_hidden"):
        speculative_generate(CausalLMRunner(target), EagleDrafter(_head(target)), ids, max_new_tokens=4)
    wide = tiny_llama(hidden=48)
    head = EagleHead(hidden_size=32, vocab_size=32, num_attention_heads=4).double()
    head._target = {"embed": target.get_input_embeddings(), "head": target.get_output_embeddings()}
    with pytest.raises(ValueError, match="hidden size mismatch"):
        speculative_generate(CausalLMRunner(wide, return_hidden=True), EagleDrafter(head), ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="already guided"):
        EagleDrafter(_head(target), guidance_scale=3.0, guided_features=True)
    assert EagleDrafter(_head(target), guided_features=True).target_hidden == "guided"


def _random_pairs(seed: int, batch: int, length: int, **head_kwargs):
    """A 1-layer tiny target, a random fp64 head on it, and random (token, feature) pairs ``[batch, length]``."""
    target = tiny_llama(layers=1, seed=0)
    head = _head(target, **head_kwargs)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 32, (batch, length), generator=g)
    features = torch.randn(batch, length, 32, generator=g, dtype=torch.float64)
    return target, head, ids, features, g


@pytest.mark.parametrize("impl", ["lean", "transformers"])
def test_rollout_features_equal_step_by_step_drafting(impl):
    """Depth d at slot i of the parallel rollout is step d of a chain drafted through the KV cache from the
    true pairs up to slot i-d+1: the training-time test trains exactly what the drafter computes."""
    _, head, ids, features, _ = _random_pairs(1, 2, 9, decoder_impl=impl)
    valid = torch.ones(2, 9, dtype=torch.bool)
    depths = rollout_features(head, ids, features, valid, steps=4)
    for root in (0, 3, 5):
        cache = head.new_cache(2)
        out = head(ids[:, : root + 1], target_hidden=features[:, : root + 1], past_key_values=cache)
        feature, cache = out.hidden_states[0][:, -1], out.past_key_values
        assert torch.allclose(depths[0][:, root], feature, atol=1e-10)
        for depth in range(2, 5):
            slot = root + depth - 1
            out = head(ids[:, slot: slot + 1], target_hidden=feature.unsqueeze(1), past_key_values=cache)
            feature, cache = out.hidden_states[0][:, -1], out.past_key_values
            assert torch.allclose(depths[depth - 1][:, slot], feature, atol=1e-10), (root, depth)


def test_rollout_with_padding_and_condition_slots():
    """Left padding shifts nothing (positions count valid slots); chains never start on a condition slot."""
    _, head, ids, features, g = _random_pairs(2, 1, 8)
    padded_ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    padded_features = torch.cat([torch.randn(1, 3, 32, generator=g, dtype=torch.float64), features], 1)
    valid = torch.cat([torch.zeros(1, 3, dtype=torch.bool), torch.ones(1, 8, dtype=torch.bool)], 1)
    plain = rollout_features(head, ids, features, torch.ones(1, 8, dtype=torch.bool), steps=3)
    padded = rollout_features(head, padded_ids, padded_features, valid, steps=3)
    for depth in range(3):
        assert torch.allclose(padded[depth][:, 3 + depth:], plain[depth][:, depth:], atol=1e-10)
    # 3 condition positions (-1 ids): 8 pair slots, 6 with tokens; depth 3 counts slots 4..7, i.e. 4 of them
    hidden = torch.randn(1, 9, 32, generator=g, dtype=torch.float64)
    cond_ids = torch.cat([torch.full((1, 3), -1), torch.randint(3, 32, (1, 6), generator=g)], 1)
    out = eagle_loss(head, cond_ids, hidden, rollout_steps=3)
    assert {"loss", "feature_loss", "ce_loss", "top1", "top1_depth1", "top1_depth2", "top1_depth3"} <= set(out)
    assert "top1_depth1" not in eagle_loss(head, cond_ids, hidden)
    assert float(out["top1_depth1"]) * 6 == pytest.approx(round(float(out["top1_depth1"]) * 6))  # token slots only
    assert float(out["top1_depth3"]) * 4 == pytest.approx(round(float(out["top1_depth3"]) * 4))
    with pytest.raises(ValueError, match="rollout_steps"):
        eagle_loss(head, cond_ids, hidden, rollout_steps=0)


def test_one_rollout_step_is_plain_teacher_forcing():
    target, head, ids, hidden, _ = _random_pairs(3, 2, 7)
    out = eagle_loss(head, ids, hidden, rollout_steps=1)
    teacher = head(ids[:, 1:], target_hidden=hidden[:, :-1], use_cache=False)
    probs = target.get_output_embeddings()(hidden[:, 1:]).softmax(-1)
    ce = -(probs * teacher.logits.log_softmax(-1)).sum(-1).mean()
    assert torch.allclose(out["ce_loss"], ce, atol=1e-10)
    deeper = eagle_loss(head, ids, hidden, rollout_steps=3)
    assert torch.allclose(deeper["ce_loss"], out["ce_loss"]) and not torch.allclose(deeper["loss"], out["loss"])


def test_rollout_training_raises_deep_agreement_over_teacher_forcing():
    """Same steps, same data: a head trained with 3 rollout steps agrees with the target at depth 3 more
    often than one trained by teacher forcing alone (which never sees its own features)."""
    target = tiny_llama(layers=2, seed=0, dtype=torch.float32)
    target.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 32, (96, 4), generator=g)
    samples = speculative_generate(CausalLMRunner(target), None, prompts, max_new_tokens=20).sequences
    sequences = torch.cat([prompts, samples], 1)
    with torch.no_grad():
        hidden = target(sequences, output_hidden_states=True).hidden_states[-1]
    train, held = slice(0, 64), slice(64, 96)
    depth3 = {}
    for steps in (1, 3):
        head = _head(target, dtype=torch.float32)
        optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
        order = torch.Generator().manual_seed(1)
        for _ in range(150):
            index = torch.randint(0, 64, (32,), generator=order)
            loss = eagle_loss(head, sequences[train][index], hidden[train][index], rollout_steps=steps)["loss"]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            depth3[steps] = float(eagle_loss(head, sequences[held], hidden[held], rollout_steps=3)["top1_depth3"])
    assert depth3[3] > depth3[1] + 0.03, depth3  # measured 0.41 vs 0.36


def test_logits_to_keep_reads_the_last_slots():
    _, head, ids, features, _ = _random_pairs(4, 2, 6)
    full = head(ids, target_hidden=features, use_cache=False)
    last = head(ids, target_hidden=features, use_cache=False, logits_to_keep=2)
    assert last.logits.shape == (2, 2, full.logits.shape[-1])
    assert torch.allclose(last.logits, full.logits[:, -2:], atol=1e-12)
    assert torch.allclose(last.hidden_states[0], full.hidden_states[0][:, -2:], atol=1e-12)  # so do the features
    blocks = _random_pairs(4, 2, 6, num_future=3)[1]  # a readout runs on the kept slots only
    full, last = (blocks(ids, target_hidden=features, use_cache=False, logits_to_keep=n) for n in (0, 1))
    assert last.logits.shape == (2, 1, 3, full.logits.shape[-1])
    assert torch.allclose(last.logits, full.logits[:, -1:], atol=1e-12)
    assert torch.allclose(last.hidden_states[0], full.hidden_states[0][:, -1:], atol=1e-12)


class _FullWidthDrafter(EagleDrafter):
    """Reference: re-feeds the committed pairs at the round's full width (K+1 columns) and reads the root
    from logits of every slot, as the drafter did before it trimmed both."""

    def _start_round(self):
        self.runner.begin_round()
        if self._pending_pairs is None:
            self._prefix_keep = torch.zeros(self._root[0].shape[0], 0, dtype=torch.long)
            return self._root
        tokens, features, _ = self._pending_pairs
        width = self._full_width
        tokens = torch.cat([tokens, tokens.new_full((tokens.shape[0], width - tokens.shape[1]), -1)], 1)
        features = torch.cat([features, features[:, :1].expand(-1, width - features.shape[1], -1)], 1)
        valid = tokens >= 0
        self._prefix_keep = torch.where(valid, torch.arange(width), -1)
        out = self.runner.forward(tokens.clamp_min(0), valid=valid, target_hidden=features)
        last = valid.long().cumsum(1).argmax(1)
        return out.logits[torch.arange(tokens.shape[0]), last], out.hidden[torch.arange(tokens.shape[0]), last]

    def commit(self, result):
        self._full_width = result.committed.shape[1]
        super().commit(result)


def test_trimmed_round_start_drafts_what_the_full_width_one_does(trained_pair):
    """The round's first head forward skips padding columns and computes one slot's logits per row; the
    drafts of every round are those of the untrimmed computation (rows accept different lengths)."""
    target, head, _ = trained_pair
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 32, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[2, :2] = 0
    runs = {}
    for name, cls in (("trimmed", EagleDrafter), ("full", _FullWidthDrafter)):
        drafter = cls(head, 4)
        proposals, accepted = [], []
        propose, commit = drafter.propose, drafter.commit
        drafter.propose = lambda pending, propose=propose, seen=proposals: seen.append(propose(pending)) or seen[-1]
        drafter.commit = lambda result, commit=commit, seen=accepted: seen.append(result.num_accepted) or commit(result)
        spec = speculative_generate(CausalLMRunner(target, return_hidden=True), drafter, ids, mask, max_new_tokens=20)
        runs[name] = (proposals, accepted, spec)
    (mine, accepted, spec), (reference, _, reference_spec) = runs["trimmed"], runs["full"]
    assert len(mine) == len(reference) > 3
    for ours, theirs in zip(mine, reference):
        assert torch.equal(ours.tokens, theirs.tokens)
    assert torch.equal(spec.sequences, reference_spec.sequences)
    # exercised: rounds whose rows accepted different lengths (rows' last slots differ), and trimmed widths
    assert any(int(a.max()) > int(a.min()) for a in accepted)
    assert any(0 < int(a.max()) < 4 for a in accepted)


def test_an_undrafted_round_is_fed_with_the_next_one(llama_pair):
    """``commit_undrafted`` (a round a wrapper drafted alone, e.g. a lookup-only round) keeps the round's pairs
    pending after the earlier ones: the head then reads both rounds in one forward and drafts exactly what it
    drafts after reading them round by round (its cache holds the same pairs either way), including right
    after prefill (compared: the next round's root logits and feature)."""
    from mmspec.speculate import PrefillContext, RoundResult

    target, _ = llama_pair
    head = _head(target)
    ids = torch.tensor([[3, 9, 4, 17, 5]])
    g = torch.Generator().manual_seed(0)

    def result(tokens: list[int], next_token: int) -> RoundResult:  # committed = pending + accepted drafts
        hidden = torch.randn(1, len(tokens), target.config.hidden_size, generator=g, dtype=torch.float64)
        return RoundResult(torch.tensor([tokens]), torch.tensor([len(tokens) - 1]), torch.tensor([next_token]),
                           hidden)

    rounds = [result([6, 7, 8], 11), result([11, 12], 13), result([13, 14, 15, 16], 20)]
    chains = {}
    for name, drafted in (("every round drafted", (True, True, True)), ("first undrafted", (False, True, True)),
                          ("second and third undrafted", (True, False, False))):
        drafter = EagleDrafter(head, 3)
        out = CausalLMRunner(target, return_hidden=True).prefill(ids, torch.ones_like(ids))
        drafter.prefill(PrefillContext(ids, torch.ones_like(ids), out, torch.tensor([6])))
        for round_result, was_drafted in zip(rounds, drafted):
            if was_drafted:
                drafter.propose(round_result.committed[:, 0])
                drafter.commit(round_result)
            else:
                drafter.commit_undrafted(round_result)
        chains[name] = drafter._start_round()  # the next round's root: logits [1, V] and feature [1, d]
    reference = chains.pop("every round drafted")
    for name, (logits, feature) in chains.items():
        assert torch.allclose(logits, reference[0], atol=1e-9) and torch.allclose(feature, reference[1], atol=1e-9), name


def test_undrafted_rounds_of_rows_with_different_lengths_are_refused(llama_pair):
    from mmspec.speculate import PrefillContext, RoundResult

    target, _ = llama_pair
    drafter = EagleDrafter(_head(target), 3)
    ids = torch.tensor([[3, 9, 4], [5, 6, 7]])
    out = CausalLMRunner(target, return_hidden=True).prefill(ids, torch.ones_like(ids))
    drafter.prefill(PrefillContext(ids, torch.ones_like(ids), out, torch.tensor([6, 6])))
    hidden = torch.zeros(2, 3, target.config.hidden_size, dtype=torch.float64)
    uneven = RoundResult(torch.tensor([[6, 7, 8], [6, -1, -1]]), torch.tensor([2, 0]), torch.tensor([1, 2]), hidden)
    drafter.commit_undrafted(uneven)  # right after prefill: nothing pending, nothing to join
    with pytest.raises(NotImplementedError, match="one image per call"):
        drafter.commit_undrafted(uneven)
