"""The private names of the libraries under the course, read in one place.

Interrupting engines, the grader's look at a learner's process group, and the MPI
backend's question whether MPI has a float16, and lesson 07's look at DDP's buckets,
reach into a few names that ipyparallel,
ipykernel, torch and mpi4py do not promise to keep.
Each is read here, by a function named for what it gives, so that a release that
renames one breaks one function; ``tests/test_private.py`` checks every one against
the installed libraries and fails naming the library and the name, not deep inside
a lesson. The taught code uses one more, torch's ``_foreach_copy_`` (lesson 02's
flat averaging: what torch's own optimizers use), checked there too.
"""

from __future__ import annotations

from typing import Any

# ipyparallel.DirectView: the method every apply goes through; the course's view
# (pcourse.tools.cluster.view) overrides it to pass an interrupt on to the engines.
VIEW_APPLY = "_really_apply"
# ipykernel's Kernel calls these around every request it handles; the interrupt
# watcher (pcourse.runtime.waits) wraps them to know whether a cell is running.
KERNEL_HOOKS = ("pre_handler_hook", "post_handler_hook")


def mux_stream(client: Any) -> Any:
    """The socket an ipyparallel Client sends a DirectView's requests on."""
    return client._mux_stream


def targets_of(result: Any) -> Any:
    """The engine ids an ipyparallel AsyncResult was sent to."""
    return result._targets


def mpi_datatype(code: str) -> Any:
    """The MPI datatype mpi4py sends a numpy type code (``"e"``: float16) as; None if none."""
    from mpi4py import MPI

    found = getattr(MPI, "_typedict", {}).get(code)
    return None if found in (None, MPI.DATATYPE_NULL) else found


def default_store() -> Any:
    """The store torch.distributed's default group met at (PrefixStores unwrapped)."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):  # PrefixStores around the TCPStore
        store = store.underlying_store
    return store


def default_group_timeout(device: str = "cpu") -> float:
    """Seconds the default group's backend for ``device`` waits before a collective fails."""
    import torch
    import torch.distributed as dist

    group = dist.distributed_c10d._get_default_group()
    return group._get_backend(torch.device(device)).options._timeout.total_seconds()


def ddp_logging_data(ddp: Any) -> dict:
    """What a DistributedDataParallel module logs about itself: its bucket sizes before
    (``bucket_sizes``) and after its rebuild (``rebuilt_bucket_sizes``), among others
    (lesson 07 reads DDP's buckets from DDP itself)."""
    return ddp._get_ddp_logging_data()


def ddp_first_bucket_bytes() -> int:
    """The cap of DDP's first bucket when ``bucket_cap_mb`` is None (torch: 1 MiB)."""
    import torch.distributed as dist

    return dist._DEFAULT_FIRST_BUCKET_BYTES


def profile_all_threads() -> Any:
    """torch.profiler's configuration that records every thread's ops, not only the
    caller's: a DDP hook launches its later allreduces from Gloo's callback threads
    (lesson 08 counts them)."""
    from torch.profiler import _ExperimentalConfig

    return _ExperimentalConfig(profile_all_threads=True)
