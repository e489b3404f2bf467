"""Run under mpiexec: compressed averaging (pcourse.beyond_sgd.compression) against exact sums.

- 16 bits: the result is each rank's gradient / p rounded to 16 bits once, summed in
  float64 here, rounded once more: what float32 sums give, and not what summing in
  16 bits hop by hop would give; float16's shared scale keeps tiny gradients and
  refuses to overflow on large ones; the bytes are the 16-bit ring's.
- PowerSGD: at a rank as large as the matrix, exact; error feedback telescopes (what
  was applied over the steps plus what the ranks still hold is everything they had);
  the numbers sent are counted from the factors.
- compare(): our float32 and DDP's float32 make the same updates; bytes shrink as
  promised.
Prints "compression: ALL OK" on rank 0.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from harness import RANK, SIZE, expect, verdict

from pcourse.backends import make_backend
from pcourse.beyond_sgd import compression as C
from pcourse.runtime.ranks import init_rank


def grads_of(rank: int, scale: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(7, 5, generator=gen) * scale, torch.randn(3, generator=gen) * scale]


def every_rank(scale: float = 1.0) -> list[list[torch.Tensor]]:
    return [grads_of(r, scale) for r in range(SIZE)]


def check_low_precision(group) -> None:
    for dtype in (torch.bfloat16, torch.float16):
        for scale in (1.0, 1e-6, 1e4):  # ordinary, below float16's range, near its top
            mine = grads_of(RANK, scale)
            sent = C.low_precision_average(mine, group, dtype)
            flat = [torch.cat([g.reshape(-1) for g in gs]) for gs in every_rank(scale)]
            if dtype == torch.float16:
                s = 2.0 ** int(torch.floor(torch.log2(
                    2**15 / (SIZE * torch.stack([(f / SIZE).abs().max() for f in flat]).max()))))
            else:
                s = 1.0
            rounded = [((f / SIZE) * s).to(dtype).double() for f in flat]
            want = sum(rounded).to(dtype).double() / s  # rounded in, summed exactly, rounded out
            got = torch.cat([g.reshape(-1) for g in mine]).double()
            what = f"{dtype} x{scale:g}"
            expect(torch.equal(got.float(), want.float()), f"{what}: not float32 sums of "
                   f"16-bit inputs (off by {(got - want).abs().max():.3g})")
            exact = sum(f.double() for f in flat) / SIZE
            expect(torch.allclose(got, exact, rtol=2e-2, atol=1e-2 * scale),
                   f"{what}: far from the exact average")
            expect(bool(torch.isfinite(got).all() and (got != 0).all()),
                   f"{what}: values overflowed or flushed to zero")
            per = -(-38 // SIZE)
            expect(sent == C.ring_bytes(per * SIZE, 2, SIZE), f"{what}: bytes {sent}")
    # summing in 16 bits hop by hop, as a ring would, gives other numbers for these inputs
    if SIZE >= 3:
        hop = torch.zeros(38, dtype=torch.bfloat16)
        for gs in every_rank():
            hop = hop + (torch.cat([g.reshape(-1) for g in gs]) / SIZE).to(torch.bfloat16)
        mine = grads_of(RANK)
        C.low_precision_average(mine, group, torch.bfloat16)
        expect(not torch.equal(hop.float(), torch.cat([g.reshape(-1) for g in mine])),
               "bf16: the float32 sums cannot be told from 16-bit ones here")


def check_powersgd(group) -> None:
    # rank as large as the matrix: the approximation is the exact average
    torch.manual_seed(0)
    layer = torch.nn.Linear(5, 4)
    gen = torch.Generator().manual_seed(7 + RANK)
    grads = [torch.randn(4, 5, generator=gen), torch.randn(4, generator=gen)]
    all_grads = [[torch.randn(4, 5, generator=g), torch.randn(4, generator=g)]
                 for g in (torch.Generator().manual_seed(7 + r) for r in range(SIZE))]
    for q, g in zip(layer.parameters(), grads, strict=True):
        q.grad = g.clone()
    psgd = C.PowerSGD(list(layer.parameters()), group, rank=4, min_compression=0.0)
    expect(layer.weight in psgd.q, "PowerSGD: the weight matrix was not compressed")
    sent = psgd.average()
    for q, i in ((layer.weight, 0), (layer.bias, 1)):
        want = sum(ag[i] for ag in all_grads) / SIZE
        expect(torch.allclose(q.grad, want, atol=1e-5), "PowerSGD at full rank: not exact")
    expect(psgd.numbers_sent() == (4 + 5) * 4 + 4, f"numbers sent {psgd.numbers_sent()}")
    expect(sent == C.ring_bytes(psgd.numbers_sent(), 4, SIZE), "PowerSGD bytes")
    # rank 1 with error feedback: applied + what the ranks still hold = everything they had
    big = torch.nn.Linear(16, 12, bias=False)
    psgd = C.PowerSGD(list(big.parameters()), group, rank=1)
    expect(big.weight in psgd.q, "PowerSGD: a 12x16 matrix at rank 1 was not compressed")
    applied, had = torch.zeros(12, 16), torch.zeros(12, 16)
    for step in range(5):
        g = torch.randn(12, 16, generator=torch.Generator().manual_seed(1000 * step + RANK))
        all_g = [torch.randn(12, 16, generator=torch.Generator().manual_seed(1000 * step + r))
                 for r in range(SIZE)]
        had += sum(all_g) / SIZE
        big.weight.grad = g.clone()
        psgd.average()
        applied += big.weight.grad
        if step == 0:
            expect(not torch.allclose(big.weight.grad, sum(all_g) / SIZE, atol=1e-3),
                   "rank 1 reproduced a random 12x16 average: the check cannot fail")
    held = psgd.error[big.weight].clone()
    dist.all_reduce(held, group=group)
    expect(torch.allclose(applied + held / SIZE, had, atol=1e-4),
           "error feedback: applied + held != the sum of the averages")


def check_compare(group) -> None:
    from pcourse.workloads.config import FrankeConfig

    rows = C.compare(steps=12, config=FrankeConfig.quick())
    got = {(r["who"], r["method"]): r for r in rows}
    expect(set(got) == {("ours", m) for m in C.METHODS} | {("DDP", m) for m in C.DDP_METHODS},
           "compare: methods missing")
    same = got["ours", "float32"]["loss"], got["DDP", "float32"]["loss"]
    expect(abs(same[0] - same[1]) <= 1e-3 * abs(same[1]), f"our float32 != DDP's: {same}")
    b = {k: r["bytes"] for k, r in got.items()}
    if SIZE > 1:
        expect(b["ours", "PowerSGD r=1"] < b["ours", "PowerSGD r=4"] < b["ours", "bf16"]
               < b["ours", "float32"], f"bytes out of order: {b}")
        # 16 bits: half of float32's, ours padded to a multiple of the ranks
        expect(0 <= b["ours", "bf16"] - b["DDP", "fp16"] < 4 * SIZE
               and b["DDP", "fp16"] == b["DDP", "float32"] / 2, f"16-bit bytes: {b}")
        expect(b["ours", "PowerSGD r=2"] == b["DDP", "PowerSGD r=2"], "PowerSGD bytes differ")
        # DDP's bytes are its hook's real allreduces: float32's are every parameter once
        from pcourse.workloads import make_workload

        n = sum(q.numel() for q in make_workload("franke", FrankeConfig.quick()).model.parameters())
        expect(b["DDP", "float32"] == C.ring_bytes(n, 4, SIZE), f"DDP's float32 bytes: {b}")
        expect(b["DDP", "PowerSGD r=1"] < b["DDP", "PowerSGD r=4"] < b["DDP", "fp16"],
               f"DDP's bytes out of order: {b}")


def main() -> int:
    init_rank()
    with make_backend("gloo") as backend:
        check_low_precision(backend.group)
        check_powersgd(backend.group)
    check_compare(None)
    return verdict(f"compression on {SIZE} ranks")


if __name__ == "__main__":
    sys.exit(main())
