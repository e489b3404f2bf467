"""Where a lesson sets ours beside a library's, the library's number is read from the
library, never from a formula of ours.

The known case, lesson 08: "our PowerSGD sends what DDP's sends". DDP's side is read by
``compression.allreduce_bytes_seen``: the allreduces the process group itself records
in torch's profiler (every thread: DDP's hook sends from its futures' callbacks). Here
on a one-rank Gloo group in this process; the numbers a hook sends do not depend on the
world size, only the ring's factor does, and ``p`` is given to the count.
"""

from __future__ import annotations

import inspect
from datetime import timedelta

import pytest
import torch

from pcourse.beyond_sgd import compression
from pcourse.beyond_sgd.compression import allreduce_bytes_seen, ring_bytes


@pytest.fixture
def gloo_group(tmp_path):
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    try:
        yield dist.new_group([0])
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_the_count_reads_the_process_groups_own_record(gloo_group):
    import torch.distributed as dist

    def two_allreduces() -> str:
        dist.all_reduce(torch.ones(6), group=gloo_group)
        dist.all_reduce(torch.ones(5, dtype=torch.float16), dist.ReduceOp.SUM, gloo_group)
        return "done"

    out, sent = allreduce_bytes_seen(two_allreduces, 4)
    assert out == "done"
    assert sent == ring_bytes(6, 4, 4) + ring_bytes(5, 2, 4) > 0
    assert allreduce_bytes_seen(lambda: None, 4)[1] == 0  # nothing sent, nothing counted


@pytest.mark.timeout(120)
@pytest.mark.parametrize("r", [1, 2, 4])
def test_ddps_powersgd_hook_sends_what_ours_counts(gloo_group, r):
    """Lesson 08's claim, checked against DDP's real messages: a step of DDP's
    powerSGD_hook, as lesson 08 sets it up, sends as many numbers as
    ``PowerSGD.numbers_sent()`` says ours sends."""
    from pcourse.workloads import make_workload
    from pcourse.workloads.config import FrankeConfig

    config = FrankeConfig.quick()
    wl = make_workload("franke", config, torch.device("cpu"))
    ours = compression.PowerSGD(list(wl.model.parameters()), gloo_group, rank=r).numbers_sent()
    ddp, _ = compression._ddp(f"PowerSGD r={r}", wl.model, gloo_group)
    opt = torch.optim.SGD(wl.model.parameters(), lr=1e-3)
    batch = torch.arange(config.batch_size)
    for _ in range(4):  # DDP's hook compresses from its start_powerSGD_iter on
        opt.zero_grad()
        loss = wl.loss_sum(ddp, batch, 0) / len(batch)
        _, sent = allreduce_bytes_seen(loss.backward, 2)
        opt.step()
    uncompressed = sum(q.numel() for q in wl.model.parameters())
    assert sent < ring_bytes(uncompressed, 4, 2), "DDP's hook did not compress: nothing to test"
    assert sent == ring_bytes(ours, 4, 2), (
        f"DDP's powerSGD_hook sent {sent} bytes a step at rank {r} (2 ranks' ring); ours "
        f"says {ring_bytes(ours, 4, 2)}")


def test_lesson_08_reads_ddps_bytes_from_ddp():
    assert "allreduce_bytes_seen" in inspect.getsource(compression.compare)
    assert "numbers_sent" not in inspect.getsource(compression._ddp), (
        "lesson 08's DDP side computes DDP's bytes with our PowerSGD's formula: read them "
        "from the process group's record (compression.allreduce_bytes_seen)")
