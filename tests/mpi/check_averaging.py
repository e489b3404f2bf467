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
from pcourse.beyond_sgd.syncbn import SyncBatchNorm1d, naive_stats
from pcourse.beyond_sgd.weight_averaging import Setup, run_method, select_ranks, serial_reference

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
close(run_method("local", backend, SETUP, k=1).final, reference, "local k=1 vs serial")
ok("local_k1_equals_serial_large_batch")
close(run_method("exact", backend, SETUP).final, reference, "exact vs serial")
ok("exact_equals_serial_large_batch")

# 1b. Momentum keeps it exact: each rank's velocity is linear in its gradients, so the
#     mean of the ranks' velocities is exact SGD's (the velocities are never averaged).
heavy = Setup(**{**SETUP.__dict__, "momentum": 0.9})
heavy_reference = serial_reference(heavy, size)
close(run_method("local", backend, heavy, k=1).final, heavy_reference,
      "momentum local k=1 vs serial")
drift = float((heavy_reference - reference).abs().max())
assert drift > 1e-6, f"momentum should change the trajectory, changed it by {drift:.3g}"
ok("momentum_local_k1_equals_serial_momentum")

# 2. A wrong implementation must be caught: with k=5 the ranks drift between averages.
drift = float((run_method("local", backend, SETUP, k=5).final - reference).abs().max())
assert drift > 1e-6, f"local k=5 should differ from serial SGD, differs by {drift:.3g}"
ok("local_k5_differs_from_serial")

# 3. Federated averaging with every rank selected is periodic averaging.
close(run_method("fedavg", backend, SETUP, k=4, fraction=1.0).final,
      run_method("local", backend, SETUP, k=4).final, "fedavg(all) vs local")
ok("fedavg_all_selected_equals_local")

# 4. Unselected ranks contribute nothing: with one rank per round and k = steps,
#    the result is that rank's solo run (serial SGD on its own shard).
solo = Setup(**{**SETUP.__dict__, "steps": 8, "eval_every": 8})
chosen = select_ranks(size, 1 / size, solo.seed, 0)
assert len(chosen) == 1
got = run_method("fedavg", backend, solo, k=8, fraction=1 / size).final
mine = run_method("local", backend, solo, k=10**6).final  # never averages: this rank alone
owner = mine.clone() if rank == chosen[0] else torch.zeros_like(mine)
backend.allreduce(owner, "sum")  # the chosen rank's solo weights, on every rank
close(got, owner, "fedavg(one rank) vs that rank's solo run")
ok("fedavg_unselected_contribute_nothing")

# 4b. A round with several clients is the mean of their solo runs (needs 3+ ranks to
#     leave someone out).
if size >= 3:
    chosen = select_ranks(size, 2 / size, solo.seed, 0)
    assert len(chosen) == 2
    got = run_method("fedavg", backend, solo, k=8, fraction=2 / size).final
    share = mine.clone() / 2 if rank in chosen else torch.zeros_like(mine)
    backend.allreduce(share, "sum")  # the mean of the chosen ranks' solo weights
    close(got, share, "fedavg(two ranks) vs the mean of their solo runs")
    ok("fedavg_round_averages_the_selected_ranks")

# 5. SyncBatchNorm1d on each rank's slice == nn.BatchNorm1d on the whole batch:
#    output, running statistics, and gradients of input, weight and bias. The
#    slices are unequal (rank r holds 3 + 2r rows), as torch's SyncBatchNorm allows.
rows = [3 + 2 * r for r in range(size)]
lo_row = sum(rows[:rank])
mine_rows = slice(lo_row, lo_row + rows[rank])
gen = torch.Generator().manual_seed(3)
full = torch.randn(sum(rows), 5, generator=gen, dtype=torch.float64) * 4 + 2
upstream = torch.randn(sum(rows), 5, generator=gen, dtype=torch.float64)
ref_bn = nn.BatchNorm1d(5).double()
xr = full.clone().requires_grad_()
out_ref = ref_bn(xr)
(out_ref * upstream).sum().backward()

sync_bn = SyncBatchNorm1d(5, backend).double()
xs = full[mine_rows].clone().requires_grad_()
out = sync_bn(xs)
mean, var, count = sync_bn.batch_stats(full[mine_rows])
close(mean, full.mean(0), "synced mean vs full-batch mean")
close(var, full.var(0, unbiased=False), "synced variance vs full-batch variance")
assert int(count) == sum(rows)
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

# 7. Float32 activations with a large mean and a small spread: the combined per-rank
#    (mean, variance, count) keep the variance; E[x²] - E[x]² loses it.
shifted = (1e4 + torch.randn(sum(rows), 5, generator=gen, dtype=torch.float64))
truth = shifted.var(0, unbiased=False)
x32 = shifted[mine_rows].float()
_, stable, _ = SyncBatchNorm1d(5, backend).batch_stats(x32)
_, naive, _ = naive_stats(x32, backend)
stable_err = float(((stable.double() - truth) / truth).abs().max())
naive_err = float(((naive.double() - truth) / truth).abs().max())
assert stable_err < 1e-3, f"rank {rank}: combined variance off by {stable_err:.3g} (relative)"
assert naive_err > 0.1, f"rank {rank}: E[x²]-E[x]² was expected to fail, off by {naive_err:.3g}"
ok("syncbn_variance_is_stable_in_float32")

# 8. run_method checks once that the ranks hold the same model, then skips per-call checks:
#    a mismatch must still be an error on every rank, not a hang.
try:
    run_method("local", backend, Setup(**{**SETUP.__dict__, "hidden": 32 + rank, "steps": 2}), k=1)
except ValueError as err:
    assert "same model" in str(err), err
else:
    raise AssertionError(f"rank {rank}: different models were not refused")
ok("different_models_refused")

backend.close()
