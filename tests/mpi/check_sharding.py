"""Run under mpiexec: ZeRO-1, ZeRO-2 and FSDP train exactly as one process does.

A small model with a parameter count that does not divide by p, tied weights (the
embedding and the output layer share one matrix) and a frozen parameter, in float64.
Each rank trains on its own slice of every global batch (equal slices, mean loss);
one process trains on the whole batch. After several steps of AdamW (weight decay
on) and of SGD with momentum, every parameter must equal the single process's to
1e-12, and every rank must hold the same. Also: FSDP's wire bytes per step match
3(p-1)/p·Ψ, ZeRO's 2(p-1)/p·Ψ, and mixed precision (bfloat16 compute) stays close to
fp32 (SGD; Adam normalises tiny gradients and so magnifies rounding).
Args: the backend (default mpi). Prints "sharding OK on p ranks".
"""

from __future__ import annotations

import sys

import torch
from mpi4py import MPI
from torch import nn

from pcourse.backends import make_backend
from pcourse.backends.counting import CountingBackend
from pcourse.sharding import FullyShardedDataParallel, ShardedOptimizer, state_bytes

COMM = MPI.COMM_WORLD
P, RANK = COMM.size, COMM.rank
STEPS, BATCH_EACH = 4, 5
torch.set_default_dtype(torch.float64)


class Tiny(nn.Module):
    """Embedding -> two blocks -> a head tied to the embedding; one frozen bias."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(13, 7)
        self.block1 = nn.Sequential(nn.Linear(7, 11), nn.Tanh())
        self.block2 = nn.Sequential(nn.Linear(11, 7), nn.Tanh(), nn.Linear(7, 7, bias=False))
        self.head = nn.Linear(7, 13)
        self.head.weight = self.embed.weight  # tied
        self.block1[0].bias.requires_grad_(False)  # frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block2(self.block1(self.embed(x))))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 13, (P * BATCH_EACH,), generator=g),
             torch.randint(0, 13, (P * BATCH_EACH,), generator=g)) for _ in range(STEPS)]


def mine(t: torch.Tensor) -> torch.Tensor:
    return t[RANK * BATCH_EACH:(RANK + 1) * BATCH_EACH]


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
}


def reference(opt_name: str) -> dict[str, torch.Tensor]:
    model = Tiny()
    cls, kw = OPTIMIZERS[opt_name]
    opt = cls(model.parameters(), **kw)
    for x, y in batches():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def compare(what: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    start = {n: p.detach() for n, p in Tiny().named_parameters()}
    for n in want:
        err = (got[n] - want[n]).abs().max().item()
        assert err < 1e-12, f"{what}: {n} differs from one process by {err:.3g}"
        assert all(torch.equal(got[n], o) for o in COMM.allgather(got[n])), \
            f"{what}: ranks disagree on {n}"
    moved = [n for n in want if not torch.equal(want[n], start[n])]
    assert "block1.0.bias" not in moved and len(moved) == len(want) - 1, (what, moved)


# Bucket caps (bytes): one bucket for the whole model, and a few buckets cut through it
CAPS = (25 << 20, 800)


def zero(stage: int, opt_name: str, backend, overlap: bool = False,
         cap: int = CAPS[0]) -> dict[str, torch.Tensor]:
    model = Tiny()
    cls, kw = OPTIMIZERS[opt_name]
    opt = ShardedOptimizer(model.parameters(), cls, backend=backend, stage=stage,
                           overlap=overlap, module=model, bucket_cap_bytes=cap, **kw)
    assert cap == CAPS[0] or len(opt.buckets) > 2, len(opt.buckets)
    for x, y in batches():
        opt.zero_grad()
        nn.functional.cross_entropy(model(mine(x)), mine(y)).backward()
        opt.step()
    opt.synchronize()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def fsdp(opt_name: str, backend, compute_dtype=None, prefetch: int = 0,
         overlap: bool = False) -> dict[str, torch.Tensor]:
    model = FullyShardedDataParallel(Tiny(), backend, shard=nn.Linear,
                                     compute_dtype=compute_dtype, prefetch=prefetch,
                                     overlap=overlap)
    cls, kw = OPTIMIZERS[opt_name]
    opt = cls(model.parameters(), **kw)
    for x, y in batches():
        opt.zero_grad()
        nn.functional.cross_entropy(model(mine(x)), mine(y)).backward()
        model.finish()
        opt.step()
    return model.full_parameters()


def wire(backend) -> None:
    """Bytes each rank hands to the backend in one step, beside the theory."""
    psi = sum(p.numel() for p in Tiny().parameters() if p.requires_grad)
    for kind, factor, ahead in (("zero1", 2, False), ("zero2", 2, False), ("fsdp", 3, False),
                                ("zero2", 2, True), ("fsdp", 3, True)):
        counter = CountingBackend(backend)  # overlap and prefetch move the same bytes
        model = Tiny()
        if kind == "fsdp":  # one unit: all of it
            model = FullyShardedDataParallel(model, counter, prefetch=int(ahead), overlap=ahead)
            opt = torch.optim.AdamW(model.parameters())
        else:
            opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, backend=counter,
                                   stage=int(kind[-1]), overlap=ahead, module=model)
        x, y = batches()[0]
        for _ in range(2):  # the second step: no agreement checks
            counter.reset()
            opt.zero_grad()
            nn.functional.cross_entropy(model(mine(x)), mine(y)).backward()
            if kind == "fsdp":
                model.finish()
            opt.step()
        padded = -(-psi // P) * P
        want = factor * (P - 1) / P * padded * 8
        assert abs(counter.total() - want) < 1e-6, (kind, counter.sent, want)
        held = state_bytes(model, opt)
        assert held["total"] > 0


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "mpi"
    with make_backend(name, timeout=60) as backend:
        for opt_name in OPTIMIZERS:
            want = reference(opt_name)
            for stage in (1, 2):
                for overlap in (False, True):
                    for cap in CAPS:
                        compare(f"ZeRO-{stage} {opt_name} overlap={overlap} cap={cap}",
                                zero(stage, opt_name, backend, overlap, cap), want)
            for prefetch, overlap in ((0, False), (1, True), (2, True), (1, False)):
                compare(f"FSDP {opt_name} prefetch={prefetch} overlap={overlap}",
                        fsdp(opt_name, backend, prefetch=prefetch, overlap=overlap), want)
        wire(backend)
        torch.set_default_dtype(torch.float32)
        lo = fsdp("sgd", backend, compute_dtype=torch.bfloat16)
        hi = fsdp("sgd", backend)
        gap = max((lo[n].double() - hi[n].double()).abs().max().item() for n in hi)
        assert 0 < gap < 0.01, f"bfloat16 compute moved the weights by {gap}"
        torch.set_default_dtype(torch.float64)
    COMM.Barrier()
    if RANK == 0:
        print(f"sharding OK on {P} ranks ({name})", flush=True)


if __name__ == "__main__":
    main()
