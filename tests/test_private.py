"""The private library names the course relies on still exist, with the shape it uses.

A library release that renames one fails here, naming it, instead of somewhere deep in
a lesson or the grader (``pcourse.runtime.private`` reads them all).
"""

from __future__ import annotations

import inspect
from datetime import timedelta

import pytest
import torch

from pcourse.runtime import private


def test_the_course_view_overrides_ipyparallels_apply_entry_with_its_signature():
    import ipyparallel as ipp

    from pcourse.tools.cluster.view import InterruptibleView

    theirs = getattr(ipp.DirectView, private.VIEW_APPLY, None)
    assert theirs is not None, f"ipyparallel's DirectView has no {private.VIEW_APPLY} any more"
    assert list(inspect.signature(theirs).parameters)[:6] == [
        "self", "f", "args", "kwargs", "targets", "block"]
    assert private.VIEW_APPLY in vars(InterruptibleView)


def test_ipyparallels_client_and_async_result_keep_the_attributes_read():
    import ipyparallel as ipp

    class Holder:
        _mux_stream = object()
        _targets = [0, 1]

    assert private.mux_stream(Holder) is Holder._mux_stream
    assert private.targets_of(Holder) == [0, 1]
    # set in their constructors: read the source, since making one needs a cluster
    assert "self._mux_stream" in inspect.getsource(ipp.Client)
    assert "self._targets" in inspect.getsource(ipp.AsyncResult)


def test_ipykernel_calls_the_hooks_around_each_request():
    from ipykernel.kernelbase import Kernel

    for hook in private.KERNEL_HOOKS:
        assert callable(getattr(Kernel, hook, None)), f"ipykernel's Kernel has no {hook}"
        assert f"self.{hook}()" in inspect.getsource(Kernel), f"ipykernel never calls {hook}"


def test_mpi4py_still_maps_numpy_type_codes_to_datatypes():
    from mpi4py import MPI

    assert isinstance(getattr(MPI, "_typedict", None), dict), "mpi4py has no MPI._typedict"
    assert private.mpi_datatype("d") == MPI.DOUBLE and private.mpi_datatype("f") == MPI.FLOAT
    assert private.mpi_datatype("no such code") is None


def test_torchs_foreach_copy_still_copies_a_list_of_tensors():
    a, b = [torch.zeros(2), torch.zeros(3)], [torch.ones(2), torch.arange(3.0)]
    torch._foreach_copy_(a, b)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.timeout(120)
def test_the_default_groups_store_and_timeout_are_read_back(tmp_path):
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=timedelta(seconds=17))
    try:
        store = private.default_store()
        assert isinstance(store, dist.FileStore), type(store)
        assert private.default_group_timeout() == 17
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_ddp_still_logs_its_buckets_and_names_its_first_bucket_cap(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    assert private.ddp_first_bucket_bytes() == 2**20
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        model = torch.nn.Linear(3, 2)
        logged = private.ddp_logging_data(DistributedDataParallel(model))
        # one bucket holding the weight and the bias, 4 bytes per float32 value
        assert int(logged["bucket_sizes"]) == 4 * (3 * 2 + 2), logged["bucket_sizes"]
    finally:
        dist.destroy_process_group()


def test_the_profiler_still_records_other_threads_ops():
    import threading

    from torch.profiler import ProfilerActivity, profile

    def add() -> None:
        torch.ones(3).add_(1)

    with profile(activities=[ProfilerActivity.CPU],
                 experimental_config=private.profile_all_threads()) as prof:
        t = threading.Thread(target=add)
        t.start()
        t.join()
    assert any(e.name == "aten::add_" for e in prof.events())
