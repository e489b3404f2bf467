"""pcourse.multinode's node-aware allreduce against Gloo's own, on spawned ranks.

``python check_node_aware.py N``: N ranks, "nodes" of every size that divides N (one rank
per node, a few, all on one); on every rank the node-aware sum of a tensor of random
whole numbers (float64: every order of adding is exact) must equal ``dist.all_reduce``'s,
and a node size that does not divide N is refused. Rank 0 prints
"node-aware allreduce OK (N ranks, nodes of ...)"; a failure exits non-zero.
"""

from __future__ import annotations

import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

from pcourse.multinode import node_aware_allreduce, node_groups


def spawned(rank: int, size: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))
    sizes = [n for n in range(1, size + 1) if size % n == 0]
    for per_node in sizes:
        groups = node_groups(per_node)
        assert groups[2] == rank - rank % per_node, (rank, per_node, groups[2])
        mine = torch.randint(-1000, 1000, (37,), generator=torch.Generator().manual_seed(rank),
                             dtype=torch.float64)
        theirs = mine.clone()
        dist.all_reduce(theirs)  # the reference: Gloo's own flat allreduce
        node_aware_allreduce(mine, *groups)
        assert torch.equal(mine, theirs), (rank, per_node)  # exact: whole numbers in float64
    try:
        node_groups(size + 1)
    except ValueError as exc:
        assert "per_node must divide" in str(exc), exc
    else:
        raise AssertionError("a node size that does not divide the world was accepted")
    dist.barrier()
    if rank == 0:
        print(f"node-aware allreduce OK ({size} ranks, nodes of {sizes})", flush=True)
    dist.destroy_process_group()


def main() -> None:
    size = int(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(spawned, args=(size, f"file://{tmp}/rendezvous"),
                                    nprocs=size)


if __name__ == "__main__":
    main()
