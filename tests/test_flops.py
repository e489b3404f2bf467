"""The FLOP count behind the benchmarks' 'how close to the limit', against closed forms."""

from __future__ import annotations

import pytest

from pcourse.tools.bench.flops import flops_per_sample, limit_rows, matmul_rate
from pcourse.workloads import make_workload
from pcourse.workloads.config import FrankeConfig


def test_franke_step_flops_are_the_matrix_products_of_forward_and_backward() -> None:
    wl = make_workload("franke", FrankeConfig(n_points=256, n_test=16), "cpu")
    h = 100  # the source's 2 -> h -> h -> 1 network
    forward = 2 * (2 * h + h * h + h * 1)  # a multiply and an add per weight
    weight_grads = forward
    input_grads = 2 * (h * h + h * 1)  # the first layer's input needs no gradient
    assert flops_per_sample(wl, wl.model) == forward + weight_grads + input_grads


def test_the_count_leaves_the_model_alone() -> None:
    wl = make_workload("franke", FrankeConfig(n_points=256, n_test=16), "cpu")
    flops_per_sample(wl, wl.model)
    assert all(p.grad is None for p in wl.model.parameters())


def test_matmul_rate_is_flops_per_second_of_the_product() -> None:
    import time

    import torch

    rate = matmul_rate(size=64, seconds=0.05)
    a = torch.randn(64, 64)
    start = time.perf_counter()
    torch.mm(a, a)
    one = time.perf_counter() - start
    assert 0 < rate and 2 * 64**3 / rate <= max(one, 1e-3) * 50  # same order as one product


def test_limit_rows_divide_achieved_by_the_limit() -> None:
    table = [{"backend": "mpi", "ranks": 2, "threads": 1, "throughput": 1000.0,
              "flops_per_sample": 6e4, "matmul_flops": 1.2e9},
             {"backend": "gloo", "ranks": 2, "threads": 1, "throughput": 10.0,
              "flops_per_sample": None, "matmul_flops": None}]
    (row,) = limit_rows(table)  # rows without a measurement are left out
    assert row["achieved"] == pytest.approx(6e7) and row["fraction"] == pytest.approx(0.05)


@pytest.mark.gpu
def test_on_a_gpu_the_limit_is_the_gpus() -> None:
    """The loop on a GPU is compared with the GPU's matmul rate, not the CPU's."""
    import torch

    cpu = matmul_rate(seconds=0.1, device="cpu")
    gpu = matmul_rate(seconds=0.1, device=torch.device("cuda", 0))
    assert gpu > 10 * cpu, (gpu, cpu)
