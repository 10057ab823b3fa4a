"""Shared test set-up: offline hub, deterministic threads, tiny transformers models."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run in Triton's interpreter; with one they must run compiled
    # (the interpreter would also take the CUDA tensors the tests then use, and test nothing of the GPU path).
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One process per core: pytest-xdist workers (scripts/test.sh runs one per core) take one thread each.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))


def tiny_llama(vocab_size: int = 32, layers: int = 2, hidden: int = 32, seed: int = 0, dtype=torch.float64):
    """A tiny random Llama causal LM (fp64 by default: exact-match comparisons need it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    # Random init gives near-uniform logits; sharpen them so drafts and targets have structure.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture
def llama_pair():
    """(target, drafter): a 2-layer target and a 1-layer drafter sharing a vocabulary of 32 tokens."""
    return tiny_llama(layers=2, seed=0), tiny_llama(layers=1, seed=1)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module of width-32 models: threads gain nothing there, and on a busy
    shared CPU two spinning threads crawl. Restores the previous count afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """Every test leaves torch's intra-op thread count as it found it: the benchmark commands set it from
    ``--threads``, and a count above a pytest-xdist worker's one core leaks into the worker's later tests,
    where spinning threads on an oversubscribed CPU made a 3-second test take minutes."""
    previous = torch.get_num_threads()
    yield
    if torch.get_num_threads() != previous:
        torch.set_num_threads(previous)
