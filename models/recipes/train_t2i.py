"""Recipe: the text-to-image target of the ``mmspec/shapes-t2i`` zoo entry.

A LlamaGen-compatible t2i transformer (8 layers, d=192 by default) trained on shapes-world images with
GenEval-template captions, tokenized by the zoo's VQ tokenizer (64 tokens per 32x32 image). Word ids
are embedded by the model's own text table (no T5). Deterministic for a seed; resumable: checkpoints
every ``--save-every`` steps under ``--work``, logs JSON lines.

    python -m mmspec.models.recipes.train_t2i --out models/zoo/shapes-t2i/transformer --steps 3000

Run long jobs in the background (``nohup ... &``); rerunning the same command resumes.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from mmspec.models.llamagen import LlamaGenTransformer
from mmspec.models.tokenizers import VQTokenizer
from mmspec.world import ShapesImageDataset, split_words, vocabulary

DEFAULT_VQ = Path(__file__).resolve().parents[1] / "zoo" / "tokenizers" / "vq"


class WordTokenizer:
    """Word-level ids over the shapes world's vocabulary (id = index in the sorted word list)."""

    def __init__(self, words: list[str]) -> None:
        self.words = list(words)
        self.index = {w: i for i, w in enumerate(self.words)}

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, text: str) -> list[int]:
        words = split_words(text)
        unknown = [w for w in words if w not in self.index]
        if unknown:
            raise ValueError(f"words outside the model's vocabulary: {unknown}")
        return [self.index[w] for w in words]

    def batch(self, texts: list[str], length: int) -> torch.Tensor:
        """Word ids ``[B, length]``, left-padded with -1 (LlamaGen's condition layout)."""
        out = torch.full((len(texts), length), -1, dtype=torch.long)
        for b, text in enumerate(texts):
            ids = self.encode(text)[:length]
            if ids:
                out[b, length - len(ids):] = torch.tensor(ids)
        return out

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"words": self.words}, indent=0))

    @classmethod
    def load(cls, path: Path) -> WordTokenizer:
        if not path.is_file():
            raise FileNotFoundError(f"no word vocabulary at {path}")
        return cls(json.loads(path.read_text())["words"])


def build_data(num: int, seed: int, vq: VQTokenizer, words: WordTokenizer, cond_len: int,
               difficulty: float, split: str = "train") -> dict[str, torch.Tensor]:
    """Render, tokenize and caption ``num`` scenes: ``{"tokens": [N, 64], "words": [N, cond_len]}``."""
    data = ShapesImageDataset(num, seed=seed, split=split, difficulty=difficulty, texts=False)
    tokens, captions = [], []
    for start in range(0, num, 500):
        items = [data[i] for i in range(start, min(num, start + 500))]
        images = torch.stack([it["image"] for it in items])
        with torch.no_grad():
            tokens.append(vq.encode(images).flatten(1))
        captions += [it["caption"] for it in items]
    return {"tokens": torch.cat(tokens), "words": words.batch(captions, cond_len), "captions": captions}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("runs/train_t2i"))
    parser.add_argument("--vq", type=Path, default=DEFAULT_VQ)
    parser.add_argument("--dim", type=int, default=192)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--cond-len", type=int, default=32)
    parser.add_argument("--train-images", type=int, default=30000)
    parser.add_argument("--difficulty", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--save-every", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)
    log = (args.work / "log.jsonl").open("a")

    vq = VQTokenizer.from_pretrained(args.vq)
    words = WordTokenizer(vocabulary())
    data_path = args.work / "data.pt"
    if data_path.is_file():
        data = torch.load(data_path)
    else:
        data = build_data(args.train_images, args.seed, vq, words, args.cond_len, args.difficulty)
        torch.save(data, data_path)
    grid_tokens = data["tokens"].shape[1]

    model = LlamaGenTransformer(dim=args.dim, n_layer=args.layers, n_head=args.heads, multiple_of=32,
                                model_type="t2i", vocab_size=vq.vocab_size, block_size=grid_tokens,
                                cls_token_num=args.cond_len, caption_dim=args.dim, text_vocab_size=len(words),
                                class_dropout_prob=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    step = 0
    ckpt = args.work / "checkpoint.pt"
    if ckpt.is_file():
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        torch.set_rng_state(state["rng"])
    warmup = 100

    def lr_at(s: int) -> float:  # linear warm-up, cosine decay to 10%
        if s < warmup:
            return args.lr * (s + 1) / warmup
        progress = (s - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.45 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item()))

    num = data["tokens"].shape[0]
    model.train()
    start = time.time()
    while step < args.steps:
        index = torch.randint(0, num, (args.batch,))
        cond = data["words"][index]
        logits = model.forward_train(cond, data["tokens"][index], condition_mask=(cond >= 0).long())
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data["tokens"][index].flatten())
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 20 == 0:
            log.write(json.dumps({"step": step, "loss": round(loss.item(), 4), "lr": lr_at(step),
                                  "seconds": round(time.time() - start, 1)}) + "\n")
            log.flush()
        if step % args.save_every == 0 or step == args.steps:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                        "rng": torch.get_rng_state()}, ckpt)
            copy.deepcopy(model).eval().to(torch.float16).save_pretrained(args.out)  # fp16 keeps the zoo small
            words.save(Path(args.out) / "text_vocab.json")
    log.close()


if __name__ == "__main__":
    main()
