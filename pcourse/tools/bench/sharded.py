"""The sharded strategies the benchmarks set beside each other, built the same way for each.

:func:`model_and_loss` gives a workload's model (the same start on every rank) and a loss
on fixed data; :func:`build` wraps it in one strategy (torch's DDP, our ZeRO-1/2 and FSDP
with and without overlap, torch's ``ZeroRedundancyOptimizer`` and FSDP2). Read by
:mod:`pcourse.tools.bench.sharding` (the benchmark) and :mod:`pcourse.tools.bench.overlap`
(its traced steps), so that neither imports the other's internals.
"""

from __future__ import annotations

from typing import Any


def model_and_loss(workload: str) -> tuple[Any, Any]:
    """A fresh model (same start on every rank) and ``loss(model, rank, step)`` on fixed data."""
    import torch

    if workload == "franke":
        from pcourse.workloads.franke import franke, make_model

        def loss(model: Any, rank: int, step: int) -> Any:
            g = torch.Generator().manual_seed(1000 * step + rank)
            xy = torch.rand(256, 2, generator=g)
            return torch.nn.functional.mse_loss(model(xy), franke(xy[:, :1], xy[:, 1:]))

        return make_model, loss
    from pcourse.workloads.vae import make_model as vae_model
    from pcourse.workloads.vae import vae_loss

    def vloss(model: Any, rank: int, step: int) -> Any:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, eps = torch.rand(128, 784, generator=g), torch.randn(128, 2, generator=g)
        logits, mu, logvar = model(x, eps)
        return vae_loss(logits, x, mu, logvar)

    return vae_model, vloss


def build(strategy: str, make_model: Any, backend: Any) -> tuple[Any, Any, Any]:
    """(module to call, optimizer, what to call after backward) for one strategy."""
    import torch
    from torch import nn

    from pcourse.buckets import DEFAULT_CAP_BYTES
    from pcourse.sharding import FullyShardedDataParallel, ShardedOptimizer

    model = make_model()
    cap = sum(p.numel() * p.element_size() for p in model.parameters()) // 4  # ~4 buckets
    group = getattr(backend, "group", None)  # torch's strategies: our backend's group
    if strategy == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3), None
    if strategy.startswith("zero"):
        overlap = strategy.endswith("-overlap")
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, backend,
                               stage=int(strategy[4]), lr=1e-3, overlap=overlap,
                               module=model if overlap else None,
                               bucket_cap_bytes=cap if overlap else DEFAULT_CAP_BYTES)
        return model, opt, None
    if strategy == "torch-zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, process_group=group,
                                       lr=1e-3)
        return ddp, zero, None
    if strategy.startswith("fsdp"):
        ahead = strategy == "fsdp-prefetch"
        fsdp = FullyShardedDataParallel(model, backend, shard=nn.Linear, prefetch=int(ahead),
                                        overlap=ahead)
        return fsdp, torch.optim.AdamW(fsdp.parameters(), lr=1e-3), fsdp.finish
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    assert group is not None  # torch's strategies run on a backend of torch's (a group)
    mesh = DeviceMesh.from_group(group, "cpu")
    for m in model.modules():
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), None
