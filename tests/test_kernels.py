"""Kernels of the core: Triton == torch reference, the reference is lossless, dispatch rules.

Without a GPU the Triton kernels run through the Triton interpreter, switched on here before any
Triton kernel module is imported (``TRITON_INTERPRET=1``). With a GPU they run compiled on CUDA and are
compared with the reference computed on CPU (same numerics as the interpreter comparison). Shapes stay
moderate because the interpreter executes every program in Python.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined

from mmspec.kernels import (  # noqa: E402
    chain_verify,
    chain_verify_reference,
    kernel_backend,
    neighborhood_mass,
    neighborhood_mass_reference,
    triton_available,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _chain_inputs(B, K, V, *, temp=1.0, draft_probs=True, dtype=torch.float32, seed=0, drafts_from_q=True):
    """Random target/draft distributions; drafts sampled from q (or uniformly), uniforms in [0, 1)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(B, K + 1, V, generator=g, dtype=torch.float64) * temp, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g, dtype=torch.float64) * temp, -1)
    if drafts_from_q:
        tokens = torch.multinomial(q.reshape(B * K, V), 1, generator=g).view(B, K)
    else:
        tokens = torch.randint(0, V, (B, K), generator=g)
    accept_u = torch.rand(B, K, generator=g, dtype=torch.float64) * 0.999
    sample_u = torch.rand(B, generator=g, dtype=torch.float64) * 0.999
    return (tokens, q.to(dtype) if draft_probs else None, target.to(dtype), accept_u.to(dtype), sample_u.to(dtype))


def _correlated_inputs(B, K, V, seed, scale=4.0):
    """A peaked target and a draft close to it (drafts sampled from q): every accepted length occurs."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g) * scale
    target = torch.softmax(logits, -1)
    q = torch.softmax(logits[:, :K] + torch.randn(B, K, V, generator=g), -1)
    tokens = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K)
    return tokens, q, target, torch.rand(B, K, generator=g), torch.rand(B, generator=g)


def _triton_vs_reference(inputs, greedy=False, splits=None):
    ref = chain_verify_reference(*inputs, greedy=greedy)
    on_device = [t.to(DEVICE) if t is not None else None for t in inputs]
    out = chain_verify(*on_device, greedy=greedy, backend="triton", splits=splits)
    return ref, tuple(o.cpu() for o in out)


def _assert_same(ref, out):
    assert out[0].dtype == torch.int64 and out[1].dtype == torch.int64
    assert torch.equal(ref[0], out[0]), (ref[0], out[0])
    assert torch.equal(ref[1], out[1]), (ref[1], out[1])


# ----------------------------------------------------------------------------------------------
# chain_verify: Triton == reference
# ----------------------------------------------------------------------------------------------

SHAPES = [  # (B, K, V)
    (3, 4, 1000),  # V not a multiple of any block size
    (4, 8, 16384),  # LlamaGen codebook
    (2, 1, 257),
    (5, 3, 64),
]


@needs_triton
@pytest.mark.parametrize("B,K,V", SHAPES)
@pytest.mark.parametrize("draft_probs", [True, False], ids=["q", "point-mass"])
@pytest.mark.parametrize("temp", [0.3, 8.0], ids=["flat", "peaked"])
def test_chain_verify_triton_matches_reference(B, K, V, draft_probs, temp):
    inputs = _chain_inputs(B, K, V, temp=temp, draft_probs=draft_probs, seed=B * 1000 + V,
                           drafts_from_q=draft_probs)
    for greedy in (False, True):
        _assert_same(*_triton_vs_reference(inputs, greedy=greedy))


@needs_triton
def test_chain_verify_triton_many_rows_hit_every_outcome():
    # Peaked target and drafts from a nearby q: rows end at every n in 0..K, so the residual, the bonus
    # and the acceptance tests are all compared on one launch.
    B, K, V = 48, 4, 300
    inputs = _correlated_inputs(B, K, V, seed=7)
    ref, out = _triton_vs_reference(inputs)
    _assert_same(ref, out)
    assert set(ref[0].tolist()) == set(range(K + 1)), "the inputs should exercise every accepted length"


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_chain_verify_triton_dtypes(dtype):
    inputs = _chain_inputs(4, 3, 700, temp=2.0, dtype=dtype, seed=3)
    for greedy in (False, True):
        _assert_same(*_triton_vs_reference(inputs, greedy=greedy))


@needs_triton
def test_chain_verify_triton_large_vocabulary():
    inputs = _chain_inputs(2, 2, 152064, temp=2.0, seed=11, drafts_from_q=True)
    for greedy in (False, True):
        _assert_same(*_triton_vs_reference(inputs, greedy=greedy))


@needs_triton
@pytest.mark.parametrize("B,K,V,splits", [(3, 4, 1000, 3), (2, 8, 16384, 8), (2, 1, 257, 2), (5, 3, 64, 4),
                                          (1, 0, 5000, 5), (2, 2, 152064, 37)])
@pytest.mark.parametrize("draft_probs", [True, False], ids=["q", "point-mass"])
def test_chain_verify_split_v_matches_reference(B, K, V, splits, draft_probs):
    """The split-V kernels pick the reference's tokens: chunks smaller than V, one chunk (V = 64 has a
    single block), an empty chain, a chunk count that does not divide V's blocks."""
    for temp in (0.3, 8.0):
        inputs = _chain_inputs(B, K, V, temp=temp, draft_probs=draft_probs, seed=B * 1000 + V + splits,
                               drafts_from_q=draft_probs)
        for greedy in (False, True):
            _assert_same(*_triton_vs_reference(inputs, greedy=greedy, splits=splits))


@needs_triton
def test_chain_verify_split_v_every_outcome_and_chunk():
    """Rows ending at every n in 0..K, sampled tokens falling in every chunk, float64 and bfloat16."""
    B, K, V = 64, 4, 300
    inputs = _correlated_inputs(B, K, V, seed=7, scale=0.5)  # flat rows: samples spread over all of V
    ref, out = _triton_vs_reference(inputs, splits=6)
    _assert_same(ref, out)
    assert set(ref[0].tolist()) == set(range(K + 1))
    from mmspec.kernels.chain_verify_split_triton import split_block_v, split_layout

    chunk, chunks = split_layout(V, 6, split_block_v(V, 6))
    assert chunks >= 4 and len(set((ref[1] // chunk).tolist())) == chunks  # every chunk drew some token
    for dtype in (torch.float64, torch.bfloat16):
        inputs = _chain_inputs(4, 3, 700, temp=2.0, dtype=dtype, seed=3)
        for greedy in (False, True):
            _assert_same(*_triton_vs_reference(inputs, greedy=greedy, splits=4))


def test_split_layout_covers_the_vocabulary_in_whole_blocks():
    from mmspec.kernels.chain_verify_split_triton import split_block_v, split_layout

    for V, splits in [(1000, 3), (16384, 8), (64, 4), (152064, 37), (5, 9), (300, 6), (257, 2)]:
        block = split_block_v(V, splits)
        chunk, chunks = split_layout(V, splits, block)
        assert chunk % block == 0 and 1 <= chunks <= splits
        assert (chunks - 1) * chunk < V <= chunks * chunk  # every chunk holds columns, together all of V
        assert chunks >= min(splits, V // 16) // 2  # a small vocabulary still splits (blocks of >= 16)


def test_chain_verify_rejects_bad_splits():
    with pytest.raises(ValueError, match="splits must be a positive integer"):
        chain_verify(*_chain_inputs(1, 1, 10), splits=0)
    with pytest.raises(ValueError, match="splits must be a positive integer"):
        chain_verify(*_chain_inputs(1, 1, 10), splits=2.5)
    ref = chain_verify_reference(*_chain_inputs(2, 2, 10))
    _assert_same(ref, chain_verify(*_chain_inputs(2, 2, 10), backend="torch", splits=4))  # no effect on torch


def _edge_cases(V=50, K=3):
    """Hand-built rows: all accepted, first rejected, p == q (residual fallback), bonus at the end."""
    B = 4
    target = torch.full((B, K + 1, V), 1.0 / V)
    q = torch.full((B, K, V), 1.0 / V)
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]])
    u_acc = torch.full((B, K), 0.5)
    u_s = torch.tensor([0.13, 0.0, 0.9, 0.3])  # u = 0 must skip zero-weight tokens
    # row 0: p == q everywhere -> every draft accepted (u q < p since u < 1), bonus from row K.
    # row 1: the first draft has p = 0 -> rejected at 0, residual max(0, p - q) is a one-hot.
    target[1, 0] = 0.0
    target[1, 0, 20] = 1.0
    # row 2: rejected at 1 because p(x_1) = q(x_1) = 0, and p_1 == q_1 -> residual is zero -> fallback
    #        to p_1 itself.
    p1 = torch.rand(V, generator=torch.Generator().manual_seed(0))
    p1[8] = 0.0
    p1 /= p1.sum()
    target[2, 1] = p1
    q[2, 1] = p1
    # row 3: u q >= p for the last draft (u = 1 - tiny) -> rejected at K-1.
    u_acc[3, 2] = 0.999
    target[3, 2] = q[3, 2] * 0.99 + 0.01 * torch.nn.functional.one_hot(torch.tensor(40), V)
    return tokens, q, target, u_acc, u_s


def test_chain_verify_reference_edge_cases():
    tokens, q, target, u_acc, u_s = _edge_cases()
    n, nxt = chain_verify_reference(tokens, q, target, u_acc, u_s)
    assert n.tolist() == [3, 0, 1, 2]
    V = target.shape[-1]
    assert nxt[0].item() == int(0.13 * V)  # inverse CDF of the uniform bonus row
    assert nxt[1].item() == 20  # the only residual mass
    from mmspec.sampling import sample_inverse_cdf

    assert nxt[2].item() == sample_inverse_cdf(target[2, 1], u_s[2]).item()  # fallback to p_1
    assert nxt[3].item() == 40  # the residual of row 3 lives on token 40 only
    # Greedy on the same rows: uniform rows have argmax 0, so only drafts equal to 0 would match.
    n_g, nxt_g = chain_verify_reference(tokens, q, target, u_acc, u_s, greedy=True)
    assert n_g.tolist() == [0, 0, 0, 0]
    assert nxt_g.tolist() == [0, 20, 0, 0]


@needs_triton
@pytest.mark.parametrize("splits", [None, 3], ids=["fused", "split-v"])
def test_chain_verify_triton_edge_cases(splits):
    inputs = _edge_cases()
    for greedy in (False, True):
        _assert_same(*_triton_vs_reference(inputs, greedy=greedy, splits=splits))
    # Deterministic drafts that the target is sure of are always accepted.
    tokens, _, target, u_acc, u_s = inputs
    sure = torch.nn.functional.one_hot(torch.cat([tokens, tokens[:, :1]], 1), target.shape[-1]).float()
    ref, out = _triton_vs_reference((tokens, None, sure, u_acc, u_s), splits=splits)
    _assert_same(ref, out)
    assert out[0].tolist() == [3, 3, 3, 3]
    assert out[1].tolist() == tokens[:, 0].tolist()  # bonus row K is the one-hot of the first draft


@needs_triton
@pytest.mark.parametrize("splits", [None, 4], ids=["fused", "split-v"])
def test_chain_verify_greedy_ties_pick_first_index(splits):
    V, K = 40, 2
    target = torch.zeros(1, K + 1, V)
    target[0, :, [5, 17]] = 0.5  # ties: torch.argmax (and the kernel) pick 5
    tokens = torch.tensor([[5, 17]])
    inputs = (tokens, None, target, torch.zeros(1, K), torch.zeros(1))
    ref, out = _triton_vs_reference(inputs, greedy=True, splits=splits)
    _assert_same(ref, out)
    assert ref[0].item() == 1 and ref[1].item() == 5
    # Ties split across the kernel's V blocks: the earlier block must win.
    V = 20000
    target = torch.zeros(2, K + 1, V)
    target[:, :, [7, 19000]] = 0.5
    inputs = (torch.tensor([[7, 19000], [19000, 7]]), None, target, torch.zeros(2, K), torch.zeros(2))
    ref, out = _triton_vs_reference(inputs, greedy=True, splits=splits)  # split-v: 7 and 19000 in chunks 0, 3
    _assert_same(ref, out)
    assert ref[0].tolist() == [1, 0] and ref[1].tolist() == [7, 7]


def test_chain_verify_empty_chain_draws_the_bonus():
    target = torch.softmax(torch.randn(2, 1, 30), -1)
    tokens = torch.zeros(2, 0, dtype=torch.long)
    inputs = (tokens, None, target, torch.zeros(2, 0), torch.tensor([0.2, 0.7]))
    n, nxt = chain_verify_reference(*inputs)
    assert n.tolist() == [0, 0]
    from mmspec.sampling import sample_inverse_cdf

    assert torch.equal(nxt, sample_inverse_cdf(target[:, 0], torch.tensor([0.2, 0.7])))
    if triton_available():
        _assert_same((n, nxt), _triton_vs_reference(inputs)[1])


@pytest.mark.parametrize("draft_probs", [True, False], ids=["q", "point-mass"])
@pytest.mark.parametrize("greedy", [False, True], ids=["sample", "greedy"])
def test_verify_tokens_agrees_with_the_kernel_contract(draft_probs, greedy):
    # verify_tokens runs its own torch path on CPU and this kernel on CUDA: both must pick the same
    # tokens from the same uniforms (drawn [B, K] for acceptance, then [B] for sampling).
    from mmspec import ExactRule, GreedyRule, verify_tokens
    from mmspec.sampling import draw_uniforms

    tokens, q, target, _, _ = _correlated_inputs(64, 4, 300, seed=21)
    q = q if draft_probs else None
    rule = GreedyRule() if greedy else ExactRule()
    out = verify_tokens(tokens, q, target, rule=rule, generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    accept_u = draw_uniforms(tuple(tokens.shape), target, g)
    sample_u = draw_uniforms((tokens.shape[0],), target, g)
    n, nxt = chain_verify_reference(tokens, q, target, accept_u, sample_u, greedy=greedy)
    assert torch.equal(out.num_accepted, n)
    assert torch.equal(out.tokens.gather(1, n.unsqueeze(1)).squeeze(1), nxt)
    assert len(set(n.tolist())) > 1, "the inputs should give several accepted lengths"


# ----------------------------------------------------------------------------------------------
# chain_verify: the reference is lossless
# ----------------------------------------------------------------------------------------------

# With 5 degrees of freedom, P(chi2 > 25) = 1.4e-4: a correct sampler fails this rarely, and the seeds
# are fixed, so the outcome is deterministic anyway. A biased sampler at these sample sizes (a shift of
# 0.01 in one probability gives chi2 ~ 100) fails by a wide margin.
CHI2_LIMIT = 25.0


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("point_mass", [False, True], ids=["sampled-drafts", "deterministic-drafts"])
def test_chain_verify_reference_is_lossless(point_mass):
    g = torch.Generator().manual_seed(1234)
    B, K, V = 200_000, 3, 6
    target_rows = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.07, 0.03],
                                [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],
                                [0.40, 0.10, 0.10, 0.10, 0.10, 0.20],
                                [1 / 6] * 6], dtype=torch.float64)
    draft_rows = torch.tensor([[0.10, 0.10, 0.30, 0.30, 0.10, 0.10],
                               [0.30, 0.20, 0.20, 0.10, 0.10, 0.10],
                               [0.25, 0.25, 0.10, 0.10, 0.10, 0.20]], dtype=torch.float64)
    target = target_rows.expand(B, K + 1, V)
    if point_mass:  # a deterministic drafter always proposes the same tokens
        draft_probs = None
        tokens = torch.tensor([2, 5, 0]).expand(B, K)
    else:
        draft_probs = draft_rows.expand(B, K, V)
        tokens = torch.stack([torch.multinomial(draft_rows[i], B, replacement=True, generator=g)
                              for i in range(K)], 1)
    accept_u = torch.rand(B, K, generator=g, dtype=torch.float64)
    sample_u = torch.rand(B, generator=g, dtype=torch.float64)
    n, nxt = chain_verify_reference(tokens, draft_probs, target, accept_u, sample_u)

    # The first emitted token follows the target's first row.
    first = torch.where(n >= 1, tokens[:, 0], nxt)
    assert _chi2(torch.bincount(first, minlength=V).double(), target_rows[0]) < CHI2_LIMIT
    # Given that draft 0 was accepted, the second emitted token follows the target's second row (the
    # rows here do not depend on the prefix, and accepting draft 0 does not look at draft 1).
    second = torch.where(n >= 2, tokens[:, 1], nxt)[n >= 1]
    assert _chi2(torch.bincount(second, minlength=V).double(), target_rows[1]) < CHI2_LIMIT
    # The test has power: the draft distribution itself is far from the target.
    assert _chi2(torch.bincount(first, minlength=V).double(), draft_rows[0]) > 100 * CHI2_LIMIT


# ----------------------------------------------------------------------------------------------
# neighborhood_mass
# ----------------------------------------------------------------------------------------------


def _neighbors(V, k, seed, pad_fraction=0.2):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(V, V, generator=g)
    scores.fill_diagonal_(float("inf"))  # neighbours are other entries
    nb = scores.topk(k, dim=1, largest=False).indices
    pad = torch.rand(V, k, generator=g) < pad_fraction
    return torch.where(pad, torch.full_like(nb, -1), nb)


def test_neighborhood_mass_reference_by_hand():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    neighbors = torch.tensor([[1, 2, 3], [0, -1, 2], [3, 1, 0], [2, -1, -1]])
    tokens = torch.tensor([[0, 1, 2, 3]])
    budget = torch.tensor([[0.55, 0.35, 0.05, 1.0]])
    total, prefix = neighborhood_mass_reference(probs, tokens, neighbors, budget)
    torch.testing.assert_close(total, torch.tensor([[0.9, 0.4, 0.7, 0.3]]))
    # token 0: 0.2, 0.5 <= 0.55, 0.9 > 0.55 -> 0.5; token 1: 0.1, (pad), 0.4 > 0.35 -> 0.1;
    # token 2: 0.4 > 0.05 -> empty prefix; token 3: everything fits -> 0.3.
    torch.testing.assert_close(prefix, torch.tensor([[0.5, 0.1, 0.0, 0.3]]))
    assert neighborhood_mass_reference(probs, tokens, neighbors)[1] is None


@needs_triton
@pytest.mark.parametrize("N,M,V,k", [(3, 1, 16384, 1000), (4, 37, 500, 60), (2, 5, 64, 1), (2, 300, 1024, 24)])
@pytest.mark.parametrize("with_budget", [True, False])
def test_neighborhood_mass_triton_matches_reference(N, M, V, k, with_budget):
    g = torch.Generator().manual_seed(N * V + k)
    probs = torch.softmax(torch.randn(N, V, generator=g) * 3, -1)
    if k == 1000:  # a random neighbour table, cheaper to build than exact nearest neighbours
        neighbors = torch.randint(-1, V, (V, k), generator=g)
    else:
        neighbors = _neighbors(V, k, seed=k)
    tokens = torch.randint(0, V, (N, M), generator=g)
    budget = torch.rand(N, M, generator=g) * 0.2 if with_budget else None
    ref_total, ref_prefix = neighborhood_mass_reference(probs, tokens, neighbors, budget)
    args = [t.to(DEVICE) if t is not None else None for t in (probs, tokens, neighbors, budget)]
    total, prefix = neighborhood_mass(*args, backend="triton")
    torch.testing.assert_close(total.cpu(), ref_total, rtol=1e-5, atol=1e-7)
    if with_budget:
        torch.testing.assert_close(prefix.cpu(), ref_prefix, rtol=1e-5, atol=1e-7)
        assert (ref_prefix <= budget + 1e-7).all() and (ref_prefix <= ref_total + 1e-7).all()
        assert (ref_prefix > 0).any(), "budgets should admit some non-empty prefixes"
    else:
        assert prefix is None


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_neighborhood_mass_triton_dtypes(dtype):
    g = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(3, 200, generator=g), -1).to(dtype)
    neighbors, tokens = _neighbors(200, 16, seed=1), torch.randint(0, 200, (3, 9), generator=g)
    budget = (torch.rand(3, 9, generator=g) * 0.05).to(dtype)
    ref = neighborhood_mass_reference(probs, tokens, neighbors, budget)
    out = neighborhood_mass(probs.to(DEVICE), tokens.to(DEVICE), neighbors.to(DEVICE), budget.to(DEVICE),
                            backend="triton")
    expected = torch.float64 if dtype == torch.float64 else torch.float32
    assert out[0].dtype == expected and out[1].dtype == expected
    torch.testing.assert_close(out[0].cpu(), ref[0])
    torch.testing.assert_close(out[1].cpu(), ref[1])


# ----------------------------------------------------------------------------------------------
# dispatch and input checks
# ----------------------------------------------------------------------------------------------


def test_kernel_backend_rules(monkeypatch):
    cpu = torch.zeros(1)
    cuda_like = types.SimpleNamespace(is_cuda=True)
    monkeypatch.delenv("MMSPEC_KERNEL_BACKEND", raising=False)
    assert kernel_backend(cpu) == "torch"
    assert kernel_backend(cuda_like) == ("triton" if triton_available() else "torch")
    monkeypatch.setattr("mmspec.kernels.triton_available", lambda: False)
    assert kernel_backend(cuda_like) == "torch"
    monkeypatch.setenv("MMSPEC_KERNEL_BACKEND", "triton")
    assert kernel_backend(cpu) == "triton"
    monkeypatch.setenv("MMSPEC_KERNEL_BACKEND", "torch")
    assert kernel_backend(cuda_like) == "torch"
    assert kernel_backend(cpu, backend="triton") == "triton"  # the argument wins over the variable
    monkeypatch.setenv("MMSPEC_KERNEL_BACKEND", "cuda")
    with pytest.raises(ValueError, match="MMSPEC_KERNEL_BACKEND"):
        kernel_backend(cpu)
    with pytest.raises(ValueError, match="backend"):
        kernel_backend(cpu, backend="fast")


@needs_triton
def test_env_variable_routes_calls_to_triton(monkeypatch):
    import mmspec.kernels as kernels

    calls = []
    real = kernels.chain_verify_torch
    monkeypatch.setattr(kernels, "chain_verify_torch", lambda *a: calls.append(1) or real(*a))
    inputs = _chain_inputs(2, 2, 100, seed=9)
    monkeypatch.setenv("MMSPEC_KERNEL_BACKEND", "torch")
    ref = kernels.chain_verify(*inputs)
    assert calls == [1]
    monkeypatch.setenv("MMSPEC_KERNEL_BACKEND", "triton")
    out = kernels.chain_verify(*[t.to(DEVICE) for t in inputs])
    assert calls == [1], "the triton backend must not fall back to the reference"
    _assert_same(ref, tuple(o.cpu() for o in out))


def test_import_does_not_need_triton():
    # Importing the kernels does not import triton; with triton hidden (as if not installed) the torch
    # path still runs and asking for the Triton backend fails with a clear ImportError.
    code = (
        "import sys, torch, mmspec, mmspec.kernels as k\n"
        "assert 'triton' not in sys.modules, 'importing mmspec.kernels imported triton'\n"
        "sys.modules['triton'] = None\n"
        "assert not k.triton_available()\n"
        "t = torch.softmax(torch.randn(2, 3, 10), -1)\n"
        "args = (torch.zeros(2, 2, dtype=torch.long), None, t, torch.rand(2, 2), torch.rand(2))\n"
        "n, x = k.chain_verify(*args)\n"
        "assert n.shape == (2,) and x.shape == (2,)\n"
        "try:\n"
        "    k.chain_verify(*args, backend='triton')\n"
        "except ImportError as e:\n"
        "    assert 'triton' in str(e)\n"
        "else:\n"
        "    raise SystemExit('expected ImportError')\n"
        "print('ok')\n"
    )
    env = {**os.environ, "MMSPEC_KERNEL_BACKEND": "auto"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def _compile_check(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    return subprocess.run([sys.executable, "-m", "mmspec.kernels.compile_check", *flags], capture_output=True,
                          text=True, env=env, timeout=600)


def _has_nvidia_backend() -> bool:
    if not triton_available():
        return False
    from triton.backends import backends

    return "nvidia" in backends


@pytest.mark.skipif(not _has_nvidia_backend(), reason="triton's NVIDIA backend is not installed")
def test_triton_kernels_compile_for_cuda():
    # The interpreter never compiles; this runs the real compiler to cubin (no GPU needed).
    result = _compile_check("--quick")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled 14 kernel variants" in result.stdout


@pytest.mark.slow
@pytest.mark.skipif(not _has_nvidia_backend(), reason="triton's NVIDIA backend is not installed")
def test_triton_kernels_compile_for_cuda_all_variants():
    result = _compile_check("--arch", "80")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled 84 kernel variants" in result.stdout


@needs_triton
def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    if DEVICE == "cuda":
        pytest.skip("only meaningful without a GPU")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        chain_verify(*_chain_inputs(1, 1, 10), backend="triton")


def test_chain_verify_rejects_bad_inputs():
    tokens, q, target, u_acc, u_s = _chain_inputs(2, 3, 20)
    with pytest.raises(ValueError, match="draft_tokens"):
        chain_verify(tokens.float(), q, target, u_acc, u_s)
    with pytest.raises(ValueError, match="target_probs"):
        chain_verify(tokens, q, target[:, :3], u_acc, u_s)
    with pytest.raises(ValueError, match="draft_probs"):
        chain_verify(tokens, q[..., :10], target, u_acc, u_s)
    with pytest.raises(ValueError, match="draft_probs"):
        chain_verify(tokens, q.double(), target, u_acc, u_s)
    with pytest.raises(ValueError, match="accept_uniforms"):
        chain_verify(tokens, q, target, u_acc[:, :2], u_s)
    with pytest.raises(ValueError, match="sample_uniforms"):
        chain_verify(tokens, q, target, u_acc, u_s + 1.5)
    with pytest.raises(ValueError, match="draft_tokens"):
        chain_verify(tokens + 20, q, target, u_acc, u_s)
    with pytest.raises(ValueError, match="target_probs"):
        chain_verify(tokens, q, target.long(), u_acc, u_s)


def test_neighborhood_mass_rejects_bad_inputs():
    probs = torch.softmax(torch.randn(2, 10), -1)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    neighbors = torch.zeros(10, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="neighbors"):
        neighborhood_mass(probs, tokens, neighbors[:9])
    with pytest.raises(ValueError, match="neighbors"):
        neighborhood_mass(probs, tokens, neighbors - 2)
    with pytest.raises(ValueError, match="tokens"):
        neighborhood_mass(probs, tokens[:1], neighbors)
    with pytest.raises(ValueError, match="tokens"):
        neighborhood_mass(probs, tokens + 10, neighbors)
    with pytest.raises(ValueError, match="budget"):
        neighborhood_mass(probs, tokens, neighbors, budget=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="probs"):
        neighborhood_mass(probs.long(), tokens, neighbors)
