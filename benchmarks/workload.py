"""The benchmark workload: a GPT-2-small-shaped model trained with AdamW on synthetic tokens.

Full size: nn.Embedding(50257, 768) + 12 x nn.TransformerEncoderLayer(768, 12, 3072, batch_first=True)
+ a final LayerNorm and an LM head tied to the embedding (logits = h @ embed.weight.T, so the
state dict holds the embedding once, as GPT-2 does). ~124 M parameters: 0.5 GB fp32 weights,
~1.5 GB with AdamW's exp_avg / exp_avg_sq. ``--quick`` uses a tiny model of the same shape family.

Batch 1 x seq 16: on the 2-core benchmark VM a step is dominated by the weight-gradient matmuls, the
dense embedding gradient and the optimizer, which do not shrink with the batch; at 2 x 32 a step took
~2 s under load, at 1 x 16 about 1 s.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class Shape:
    vocab: int = 50257
    d_model: int = 768
    heads: int = 12
    ffn: int = 3072
    layers: int = 12
    batch: int = 1
    seq: int = 16

    def to_dict(self) -> dict:
        return asdict(self)


FULL = Shape()
QUICK = Shape(vocab=1000, d_model=64, heads=4, ffn=128, layers=2, batch=1, seq=16)
# The busy-host scenario's model: ~60 MB of state (weights + AdamW), so that every peer's run with CPU-bound
# neighbours fits in minutes on the 2-core box; the issue it reproduces saw a 6 MB checkpoint starve.
BUSY = Shape(vocab=8192, d_model=256, heads=4, ffn=1024, layers=4, batch=1, seq=16)

# Training uses one intra-op thread: the second core of the 2-core benchmark box stands in for the
# host CPU time that a GPU training job leaves to background work (copies, CRCs, I/O). Every peer
# runs under the same setting. BENCH_TRAIN_THREADS=0 keeps torch's default (every core training: the
# plain loop of issue 53's fourth CPU figure, where the background has no core of its own).
TRAIN_THREADS = int(os.environ.get("BENCH_TRAIN_THREADS", "1")) or torch.get_num_threads()


class GPTish(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(s.d_model, s.heads, s.ffn, dropout=0.0, batch_first=True)
            for _ in range(s.layers)
        )
        self.norm = nn.LayerNorm(s.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for blk in self.blocks:
            h = blk(h)
        return F.linear(self.norm(h), self.embed.weight)  # tied LM head


def setup_threads() -> None:
    torch.set_num_threads(TRAIN_THREADS)


def tune_malloc() -> bool:
    """Make glibc keep freed memory for reuse instead of handing it back to the kernel each step.

    Every backward of this model allocates and frees ~300 MB of gradient temporaries (the tied
    embedding/LM-head weight gradients). With glibc's defaults each of them is a fresh ``mmap`` that is
    page-faulted and zeroed, then ``munmap``-ed: half the CPU time of a step is kernel time, and step
    times swing by +-40% from one step to the next, which buries the stalls being measured. This is the
    problem the PyTorch CPU performance guide solves with jemalloc/tcmalloc; glibc's own switches do
    the same here (no mmap for large blocks, no trimming of the heap top). Called at the start of the
    stall-measuring tasks of every peer alike (not in the (c)/(d)/(e) tasks). Returns False off glibc.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_max = -1, -4  # from <malloc.h>
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
    except (OSError, AttributeError):
        return False


def make_optimizer(params) -> torch.optim.Optimizer:
    # fused=True: the CPU fused AdamW kernel is ~5x faster than the foreach one at this size, which keeps
    # a step well under ~1 s on 2 cores. Its state (exp_avg, exp_avg_sq, step) is the same as AdamW's.
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def build(shape: Shape, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPTish(shape)
    return model, make_optimizer(model.parameters())


class Batches:
    """Deterministic synthetic token batches (next-token prediction on random tokens)."""

    def __init__(self, shape: Shape, n: int = 8, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = [torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g) for _ in range(n)]
        self.i = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.data[self.i % len(self.data)]
        self.i += 1
        return b[:, :-1], b[:, 1:]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batches: Batches) -> float:
    x, y = batches.next()
    loss = loss_fn(model, x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


def make_state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def unique_tensors(obj) -> list[torch.Tensor]:
    """The tensors reachable from ``obj`` (dicts, lists, tuples), one per storage (the first seen), detached;
    empty storages left out."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []

    def walk(o) -> None:
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            if st.nbytes() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                out.append(o.detach())
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return out


def tensor_bytes(obj) -> int:
    """Bytes of unique tensor storage reachable from ``obj`` (what a deduplicating saver writes)."""
    return sum(t.untyped_storage().nbytes() for t in unique_tensors(obj))
