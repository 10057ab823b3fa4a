"""Nearest codebook neighbours: the latent neighbourhoods of LANTERN's relaxed acceptance.

One implementation for every image tokenizer (the shapes ``VQTokenizer``, LlamaGen's VQ model, Janus'
VQ head), so the table and its tie rule do not depend on which model produced the codebook.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def nearest_neighbors(embeddings: torch.Tensor, k: int, chunk: int = 1024) -> torch.Tensor:
    """The ``k`` nearest OTHER rows of ``embeddings [V, D]`` for every row (squared L2 in float64), nearest
    first: LongTensor ``[V, k]`` on the embeddings' device.

    Equally distant rows are ordered by index, also at the k-th place (so the table is deterministic
    whatever the codebook's duplicates). Distances are computed ``chunk`` rows at a time (``chunk * V``
    doubles: 128 MB for V = 16384 at the default).
    """
    if not isinstance(embeddings, torch.Tensor) or embeddings.ndim != 2 or not embeddings.is_floating_point():
        got = tuple(embeddings.shape) if isinstance(embeddings, torch.Tensor) else type(embeddings).__name__
        raise ValueError(f"embeddings must be a float tensor [V, D], got {got}")
    vocab = embeddings.shape[0]
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= vocab - 1:
        raise ValueError(f"k must be an integer in [1, {vocab - 1}], got {k!r}")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    points = embeddings.detach().double()
    squares = (points * points).sum(-1)  # [V]
    out = []
    for start in range(0, vocab, chunk):
        rows = points[start:start + chunk]  # [c, D]
        d2 = (squares[start:start + chunk, None] + squares[None, :] - 2 * rows @ points.T).clamp_min(0)  # [c, V]
        d2[torch.arange(len(rows)), torch.arange(start, start + len(rows))] = float("inf")  # not itself
        # every row tied with the k-th distance is a candidate: take all of them, then order by (distance, index)
        kth = d2.topk(k, dim=-1, largest=False).values[:, -1:]
        candidates = int((d2 <= kth).sum(-1).max())
        index = d2.topk(candidates, dim=-1, largest=False).indices.sort(-1).values
        by_distance = torch.sort(d2.gather(-1, index), dim=-1, stable=True).indices
        out.append(index.gather(-1, by_distance)[:, :k])
    return torch.cat(out).to(torch.long)
