"""Gloo and NCCL through torch.distributed (lesson 04).

A backend here is a process group and the collectives on it. Where the group comes
from, the first of these that applies:

1. ``comm`` is a torch.distributed process group: the backend runs on that group.
2. No ``comm``, not launched by mpiexec, and torch.distributed is set up already or
   torchrun's variables are set: torch's own default group (``env://`` under torchrun).
   So the backends work under ``torchrun`` and ``torch.multiprocessing`` without MPI.
3. Otherwise MPI (``comm``, default COMM_WORLD) gives rank and size, and rank 0 opens
   the store and broadcasts where it is: :func:`pcourse.backends.bootstrap.rendezvous`,
   which also says how the address and port are chosen.

In cases 2 and 3 each backend object gets its *own* group on top of torch's default
group, so a re-run notebook cell simply makes another, and gloo, nccl and an older
gloo object can all live at once. In case 3 ``comm`` may be any part of the job (a
``Split`` sub-communicator, a :class:`pcourse.mesh.Mesh` dimension): the group is
``new_group`` over its members, numbered as ``comm`` numbers them, and backends of
different membership live side by side. Making one is collective over every rank of
the default group, each passing its own part (the rule, and why, is in
:mod:`pcourse.backends.bootstrap`). Pass ``backend.group`` to code that takes a
process group (DDP's ``process_group=``).

Every collective has a deadline: ``timeout`` (default:
:func:`pcourse.backends.base.collective_timeout`) is the process group's timeout,
after which a stuck collective raises instead of hanging. Gloo's collectives are
waited for in short slices, so that an interrupt stops the wait between two; the
NCCL barrier, the one NCCL wait that blocks the CPU, is polled likewise
(:mod:`pcourse.runtime.waits`).

At one rank the NCCL backend runs too (one GPU is the common machine): it then
checks the plumbing (device, stream, dtypes, the group), not a reduction across GPUs.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from pcourse.backends import bootstrap
from pcourse.backends.base import (
    AsyncBackend,
    BackendUnavailable,
    Pending,
    Work,
    collective_timeout,
    private_comm,
)
from pcourse.runtime.ranks import launcher, pick_gpu
from pcourse.runtime.waits import poll_work, wait_p2p, wait_work

_kept: list[Any] = []  # groups with a collective given up on mid-way (see close)


class _TorchBackend(AsyncBackend):
    dist_backend: str  # "gloo" or "nccl"
    ifname_var: str  # the environment variable naming the socket interface

    def __init__(self, comm: Any = None, *, device: str | torch.device | None = None,
                 timeout: float | None = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.timeout = collective_timeout(timeout)  # also the rendezvous's
        self.group = None
        self._given_up: Any = None  # the collective's handle a wait gave up on
        self._owns_group = not isinstance(comm, dist.ProcessGroup)
        if not self._owns_group:  # 1. the caller's group, used as it is
            self.rank, self.size = dist.get_rank(comm), dist.get_world_size(comm)
            self.device = self._pick_device(device, None)
            self.group, self.address = comm, bootstrap.address()
            return
        if comm is None and launcher() != "mpi" and (dist.is_initialized()
                                                     or launcher() == "torchrun"):
            parts, mine = self._from_torch(device)  # 2. torchrun, torch.multiprocessing
        else:
            parts, mine = self._from_mpi(comm, device)  # 3. the MPI bootstrap
        self.address = bootstrap.address()
        with bootstrap.binding(self.ifname_var):
            self.group = self._new_groups(parts, mine)
            bootstrap.joined()
            self._connect()

    def _from_torch(self, device: str | torch.device | None) -> tuple[list[list[int]], int]:
        bootstrap.from_env(self.timeout)
        self.rank, self.size = self._dist.get_rank(), self._dist.get_world_size()
        self.device = self._pick_device(device, None)
        return [list(range(self.size))], 0  # one group: every rank of the default group

    def _from_mpi(self, comm: Any, device: str | torch.device | None
                  ) -> tuple[list[list[int]], int]:
        mpi = private_comm(comm, self.name)
        try:
            self.rank, self.size = mpi.Get_rank(), mpi.Get_size()
            self.device = self._pick_device(device, mpi)
            return bootstrap.groups_for(mpi, self.ifname_var, self.timeout)
        finally:
            mpi.Free()

    def _new_groups(self, parts: list[list[int]], mine: int) -> Any:
        """Every part's group, made in order on every rank (bootstrap's rule); this rank's.

        A part lists default-group ranks in the order of its communicator's ranks, so
        that this backend's rank is its rank in ``comm``, as for the MPI backends."""
        import inspect

        dist, timeout = self._dist, timedelta(seconds=self.timeout)
        keeps_order = "sort_ranks" in inspect.signature(dist.new_group).parameters
        if not keeps_order and parts[mine] != sorted(parts[mine]):
            raise ValueError("this torch numbers a group's ranks in the job's order: make the "
                             "communicator with Split(color, key=rank) so its order is the same")
        groups = [dist.new_group(ranks=part, backend=self.dist_backend, timeout=timeout,
                                 **({"sort_ranks": False} if keeps_order else {}))
                  for part in parts]
        return groups[mine]

    def _pick_device(self, device: str | torch.device | None, mpi: Any) -> torch.device:
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"{self.name} reduces CPU tensors; got device={device!r}")
        return torch.device("cpu")

    def _connect(self) -> None:
        """Open the group's connections now, while the socket interface is chosen."""
        return None  # Gloo connects when the group is made

    def _live(self) -> Any:
        if self.group is None:
            raise RuntimeError(f"this {self.name} backend was closed; create a new one")
        self._check_in_step()
        return self.group

    def _wait(self, handle: Any, what: str, poll: bool = False) -> None:
        """Wait for a collective torch started; an interrupt stops a Gloo wait.

        ``poll``: for a wait that blocks the CPU (NCCL's barrier), ask until it is done,
        so an interrupt stops it too, and CollectiveTimeout after the backend's timeout.
        """

        def wait() -> None:
            if poll:
                poll_work(handle, self.timeout, what)
            else:
                wait_work(handle, self.dist_backend == "gloo")

        try:
            self._wait_for(wait, what)
        except BaseException:
            self._given_up = handle  # close() must know whether it still runs
            raise

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum", *,
                        check: bool = True) -> Work:
        self._agree(tensor, check, op=op)
        group = self._live()
        buf = tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()
        before, after = self.avg_divisors(buf.dtype, op)  # avg: 16 bits divide first
        if before > 1:
            buf.div_(before)
        handle = self._dist.all_reduce(buf, op=self._reduce_op(op), group=group, async_op=True)

        def finish() -> None:
            if after > 1:
                buf.div_(after)
            _copy_back(tensor, buf)

        return Pending(lambda: self._wait(handle, "allreduce"), finish, keep=(tensor, buf),
                       test=handle.is_completed)

    def broadcast(self, tensor: torch.Tensor, root: int = 0, *,
                  check: bool = True) -> torch.Tensor:
        self._agree(tensor, check, root=root)
        buf = tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()
        # torch names the root by its rank in the default group; ours may be a subgroup.
        src = self._dist.get_global_rank(self._live(), root)
        self._wait(self._dist.broadcast(buf, src=src, group=self._live(), async_op=True),
                   "broadcast")
        _copy_back(tensor, buf)
        return tensor

    def barrier(self) -> None:
        self._wait(self._dist.barrier(group=self._live(), async_op=True), "barrier")

    def close(self) -> None:
        if self.group is None:
            return
        if not self._owns_group:  # the caller's group: the caller closes it
            self.group = None
            return
        if self._given_up is not None and not self._given_up.is_completed():
            # A collective this rank stopped waiting for still runs, and whatever frees
            # its group waits for it to fail (up to the timeout), so the group is kept
            # for the process's life, and the default group with it.
            _kept.append(self.group)
            self.group = None
            return
        if not self._gave_up:
            # Ranks that tear Gloo down while a peer is still finishing its last
            # collective can abort ("terminate called without an active exception"):
            # meet first, so every rank leaves together (bounded by the group timeout).
            try:
                self.barrier()
            except Exception:  # noqa: BLE001 - a dead peer must not stop us releasing ours
                pass
        self._dist.destroy_process_group(self.group)
        self.group = None
        bootstrap.release()

    def _reduce_op(self, op: str) -> Any:
        R = self._dist.ReduceOp
        # Gloo has no AVG: a sum, divided as avg_divisors says; NCCL has one (native_avg).
        return {"sum": R.SUM, "avg": R.AVG if self.native_avg else R.SUM, "max": R.MAX,
                "min": R.MIN, "prod": R.PRODUCT}[op]

    # ---------------------------------------------- point to point (lesson 12)
    def send(self, tensor: torch.Tensor, dst: int) -> Work:
        """torch.distributed's ``isend`` on this group (``dst``: the rank in it)."""
        self._check_peer(tensor, dst, "send")
        handle = self._dist.isend(tensor.detach(), group=self._live(), group_dst=dst)
        return Pending(lambda: self._wait_p2p(handle, f"send to rank {dst}"), keep=(tensor,))

    def _wait_p2p(self, handle: Any, what: str) -> None:
        """Wait for an isend/irecv until the deadline (:func:`pcourse.runtime.waits.wait_p2p`
        says why in one wait); a Gloo send says it is done only to ``wait``."""
        self._wait_for(lambda: wait_p2p(handle, self.timeout, what), what)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """torch.distributed's ``irecv``, polled until done or the deadline."""
        self._check_peer(tensor, src, "recv")
        handle = self._dist.irecv(tensor.detach(), group=self._live(), group_src=src)
        self._wait_p2p(handle, f"recv from rank {src}")
        return tensor

    # ---------------------------------------------------- sharding (lesson 10)
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", *,
                       check: bool = True) -> torch.Tensor:
        """torch.distributed's ``reduce_scatter_tensor``, waited for like allreduce."""
        self.reduce_scatter_async(output, input, op, check=check).wait()
        return output

    def reduce_scatter_async(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                             *, check: bool = True) -> Work:
        self._agree_blocks("reduce_scatter", output, input, check, op)
        group = self._live()
        before, after = self.avg_divisors(input.dtype, op)
        send = input.detach() if before == 1 else input.detach() / before  # input unchanged
        # torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single
        reduce_scatter = getattr(self._dist, "reduce_scatter_single", None) \
            or self._dist.reduce_scatter_tensor
        handle = reduce_scatter(output.detach(), send, op=self._reduce_op(op), group=group,
                                async_op=True)

        def finish() -> None:
            if after > 1:
                output.detach().div_(after)

        return Pending(lambda: self._wait(handle, "reduce_scatter"), finish,
                       keep=(output, input, send), test=handle.is_completed)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                   check: bool = True) -> torch.Tensor:
        """torch.distributed's ``all_gather_into_tensor``, waited for like allreduce."""
        self.all_gather_async(output, input, check=check).wait()
        return output

    def all_gather_async(self, output: torch.Tensor, input: torch.Tensor, *,
                         check: bool = True) -> Work:
        self._agree_blocks("all_gather", output, input, check, None)
        all_gather = getattr(self._dist, "all_gather_single", None) \
            or self._dist.all_gather_into_tensor  # the name before torch 2.13
        handle = all_gather(output.detach(), input.detach(), group=self._live(), async_op=True)
        return Pending(lambda: self._wait(handle, "all_gather"), keep=(output, input),
                       test=handle.is_completed)


def _copy_back(tensor: torch.Tensor, buf: torch.Tensor) -> None:
    """Where a contiguous copy was reduced in place of ``tensor``, copy the result back."""
    if buf.data_ptr() != tensor.data_ptr():
        tensor.detach().copy_(buf)


class GlooBackend(_TorchBackend):
    """torch.distributed with Gloo: CPU tensors, TCP between processes."""

    name = "gloo"
    dist_backend = "gloo"
    ifname_var = "GLOO_SOCKET_IFNAME"


class NCCLBackend(_TorchBackend):
    """torch.distributed with NCCL: one GPU per rank, GPU tensors only."""

    name = "nccl"
    dist_backend = "nccl"
    ifname_var = "NCCL_SOCKET_IFNAME"
    needs_gpu = True
    native_avg = True  # NCCL's own AVG (floating types; avg of integers is refused before)

    def __init__(self, comm: Any = None, *, device: str | torch.device | None = None,
                 timeout: float | None = None) -> None:
        from pcourse.backends import unavailable_reason

        reason = unavailable_reason("nccl")  # before any communication: fails fast, alone
        if reason:
            raise BackendUnavailable(f"backend 'nccl' cannot run here: {reason}")
        super().__init__(comm, device=device, timeout=timeout)

    def _pick_device(self, device: str | torch.device | None, mpi: Any) -> torch.device:
        return pick_gpu(self.name, device, mpi)

    def _check_tensor(self, tensor: torch.Tensor, op: str | None) -> None:
        if tensor.device != self.device:
            raise ValueError(f"nccl works on tensors on {self.device}, got one on "
                             f"{tensor.device}; move it with .to({str(self.device)!r})")

    def _connect(self) -> None:
        # NCCL opens its sockets at the first collective: make that happen here.
        self.barrier()

    def barrier(self) -> None:
        # Its wait blocks the CPU until the GPU has done it: polled, so an interrupt or
        # the deadline ends it.
        self._wait(self._dist.barrier(group=self._live(), async_op=True,
                                      device_ids=[self.device.index]), "barrier", poll=True)
