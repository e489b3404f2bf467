"""ZeRO and FSDP without MPI, on torch.distributed's own group: ``torchrun
--nproc-per-node N check_sharding.py``.

Each rank initialises torch.distributed (Gloo, ``env://``) itself; the sharded
optimizer is given no backend (torch's default group) and the FSDP wrapper the group
object. Both must train as one process does (float64, AdamW, a parameter count no
rank count here divides). Rank 0 prints "sharding without MPI OK (torchrun, N ranks)".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from pcourse.sharding import FullyShardedDataParallel, ShardedOptimizer

STEPS, EACH = 3, 4


def model() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(3, 7), nn.Tanh(), nn.Linear(7, 2)).double()  # 42 params


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(size * EACH, 3, generator=torch.Generator().manual_seed(step),
                    dtype=torch.float64)
    return x, torch.sin(x[:, :2])


def train(net: nn.Module, opt: torch.optim.Optimizer, rank: int, size: int,
          finish=None) -> None:
    for step in range(STEPS):
        x, y = batch(step, size)
        mine = slice(rank * EACH, (rank + 1) * EACH)
        opt.zero_grad()
        F.mse_loss(net(x[mine]), y[mine]).backward()
        if finish:
            finish()
        opt.step()


def main() -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    one = model()
    o = torch.optim.AdamW(one.parameters(), lr=0.05)
    for step in range(STEPS):  # one process, the whole batch
        x, y = batch(step, size)
        o.zero_grad()
        F.mse_loss(one(x), y).backward()
        o.step()
    want = dict(one.named_parameters())
    zero = model()
    train(zero, ShardedOptimizer(zero.parameters(), torch.optim.AdamW, lr=0.05, stage=2),
          rank, size)
    fsdp = FullyShardedDataParallel(model(), dist.group.WORLD, shard=nn.Linear)
    train(fsdp, torch.optim.AdamW(fsdp.parameters(), lr=0.05), rank, size,
          fsdp.finish)
    for what, got in (("ZeRO-2", dict(zero.named_parameters())),
                      ("FSDP", fsdp.full_parameters())):
        for n, p in want.items():
            assert torch.allclose(got[n], p, rtol=1e-10, atol=1e-12), (what, n)
    dist.barrier()
    if rank == 0:
        print(f"sharding without MPI OK (torchrun, {size} ranks)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
