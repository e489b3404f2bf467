"""Run under mpiexec: parameter averaging and SyncBatchNorm1d against serial references.

Every check compares with something computed independently in this process: a
serial large-batch SGD run, nn.BatchNorm1d on the concatenated global batch, or a
closed form. Rank 0 prints one "OK name" line per check; any failure raises.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from pcourse.backends import make_backend
from pcourse.beyond_sgd.syncbn import SyncBatchNorm1d
from pcourse.beyond_sgd.weight_averaging import Setup, select_ranks, serial_reference, train

torch.set_num_threads(1)
backend = make_backend(sys.argv[1] if len(sys.argv) > 1 else "mpi")
rank, size = backend.rank, backend.size
SETUP = Setup(steps=40, eval_every=40, dtype="float64", n_train=1024, n_test=128)


def ok(name: str) -> None:
    if rank == 0:
        print("OK", name, flush=True)


def close(a: torch.Tensor, b: torch.Tensor, what: str, atol: float = 1e-10) -> None:
    err = float((a.detach() - b.detach()).abs().max())
    if not err <= atol:
        raise AssertionError(f"rank {rank}: {what} differs by {err:.3g} (atol {atol})")


# 1. Averaging weights after every plain SGD step is gradient averaging, which is
#    serial SGD on the ranks' concatenated batches.
reference = serial_reference(SETUP, size)
close(train("local", backend, SETUP, k=1).final, reference, "local k=1 vs serial")
ok("local_k1_equals_serial_large_batch")
close(train("exact", backend, SETUP).final, reference, "exact vs serial")
ok("exact_equals_serial_large_batch")

# 2. A wrong implementation must be caught: with k=5 the ranks drift between averages.
drift = float((train("local", backend, SETUP, k=5).final - reference).abs().max())
assert drift > 1e-6, f"local k=5 should differ from serial SGD, differs by {drift:.3g}"
ok("local_k5_differs_from_serial")

# 3. Federated averaging with every rank selected is periodic averaging.
close(train("fedavg", backend, SETUP, k=4, fraction=1.0).final,
      train("local", backend, SETUP, k=4).final, "fedavg(all) vs local")
ok("fedavg_all_selected_equals_local")

# 4. Unselected ranks contribute nothing: with one rank per round and k = steps,
#    the result is that rank's solo run (serial SGD on its own shard).
solo = Setup(**{**SETUP.__dict__, "steps": 8, "eval_every": 8})
chosen = select_ranks(size, 1 / size, solo.seed, 0)
assert len(chosen) == 1
got = train("fedavg", backend, solo, k=8, fraction=1 / size).final
mine = train("local", backend, solo, k=10**6).final  # never averages: this rank alone
owner = mine.clone() if rank == chosen[0] else torch.zeros_like(mine)
backend.allreduce(owner, "sum")  # the chosen rank's solo weights, on every rank
close(got, owner, "fedavg(one rank) vs that rank's solo run")
ok("fedavg_unselected_contribute_nothing")

# 5. SyncBatchNorm1d on each rank's slice == nn.BatchNorm1d on the whole batch:
#    output, running statistics, and gradients of input, weight and bias.
gen = torch.Generator().manual_seed(3)
full = torch.randn(6 * size, 5, generator=gen, dtype=torch.float64) * 4 + 2
upstream = torch.randn(6 * size, 5, generator=gen, dtype=torch.float64)
ref_bn = nn.BatchNorm1d(5).double()
xr = full.clone().requires_grad_()
out_ref = ref_bn(xr)
(out_ref * upstream).sum().backward()

sync_bn = SyncBatchNorm1d(5, backend).double()
mine_rows = slice(6 * rank, 6 * (rank + 1))
xs = full[mine_rows].clone().requires_grad_()
out = sync_bn(xs)
mean, var, count = sync_bn.batch_stats(full[mine_rows])
close(mean, full.mean(0), "synced mean vs full-batch mean")
close(var, full.var(0, unbiased=False), "synced variance vs full-batch variance")
assert int(count) == 6 * size
(out * upstream[mine_rows]).sum().backward()
close(out, out_ref[mine_rows].detach(), "SyncBatchNorm1d output")
close(sync_bn.running_mean, ref_bn.running_mean, "running_mean")
close(sync_bn.running_var, ref_bn.running_var, "running_var")
close(xs.grad, xr.grad[mine_rows], "input gradient")
for name in ("weight", "bias"):  # each rank holds its share; the sum is the full gradient
    g = getattr(sync_bn, name).grad.clone()
    backend.allreduce(g, "sum")
    close(g, getattr(ref_bn, name).grad, f"{name} gradient")
ok("syncbn_matches_full_batch")

# 6. ...and local statistics do not (for size > 1): the check can fail.
if size > 1:
    local_bn = SyncBatchNorm1d(5, None).double()
    local_out = local_bn(full[mine_rows])
    assert float((local_out - out_ref[mine_rows]).detach().abs().max()) > 1e-3
    ok("local_bn_differs_from_full_batch")

backend.close()
