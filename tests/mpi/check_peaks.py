"""Run under mpiexec: the most a training step holds, measured by torch's allocator
(counted from before the model is built), is the peak theory plus what the theory
leaves out, for DDP, ZeRO-1, ZeRO-2 (overlapped too) and FSDP (prefetching, and in
bfloat16): 0 <= measured - theory <= LEFT_OUT on every rank. Prints "peaks OK on p ranks".
"""

from __future__ import annotations

import torch
from mpi4py import MPI
from torch import nn

from pcourse.backends import make_backend
from pcourse.sharding import held_in_step, peak_theory_bytes

COMM = MPI.COMM_WORLD
# What the theory leaves out of a step of the net below: its 4-sample batch's
# activations (under bfloat16 with their casts), DDP's flags, the padding. Under one
# layer's 16,640 bytes, so a theory that misses a copy of a layer fails.
LEFT_OUT = 12 * 1024
LAYER = 4 * (64 * 64 + 64)
VARIANTS = {"ddp": {}, "zero1": {}, "zero2": {},
            "zero2 overlap": {"overlap": True, "bucket_cap_bytes": LAYER},
            "fsdp": {"shard": nn.Linear},
            "fsdp prefetch": {"shard": nn.Linear, "prefetch": 1, "overlap": True},
            "fsdp bf16": {"shard": nn.Linear, "compute_dtype": torch.bfloat16}}


def deep_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 64), nn.ReLU(),
                         *(m for _ in range(5) for m in (nn.Linear(64, 64), nn.ReLU())),
                         nn.Linear(64, 1))


def main() -> None:
    torch.set_num_threads(1)
    x = torch.rand(4, 2, generator=torch.Generator().manual_seed(COMM.rank))
    with make_backend("mpi", timeout=60) as backend:
        for variant, options in VARIANTS.items():
            strategy = variant.split()[0]
            held, _ = held_in_step(strategy, deep_net, backend,
                                   lambda m: m(x).square().mean(), **options)
            theory = peak_theory_bytes(strategy, deep_net(), COMM.size, **options)
            assert 0 <= held - theory <= LEFT_OUT, \
                f"rank {COMM.rank}, {variant}: measured {held} B, theory {theory:.0f} B"
    COMM.Barrier()
    if COMM.rank == 0:
        print(f"peaks OK on {COMM.size} ranks", flush=True)


if __name__ == "__main__":
    main()
