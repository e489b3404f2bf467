"""The runtime layer: what the taught code and the tools both stand on, and nothing else.

``ranks`` tells a process its rank and device (and picks a GPU per rank); ``waits``
makes every wait on a peer interruptible and bounded (one exception,
:class:`~pcourse.runtime.waits.CollectiveTimeout`); ``agree`` has the ranks check that
they called a collective alike; ``bootstrap`` is where torch.distributed's ranks meet;
``reaping`` finds the processes a run marked, ends them, and sweeps what MPI left in
``/dev/shm``; ``private`` reads the names torch, ipyparallel and ipykernel do not
promise to keep. Nothing here imports the lessons' modules or the tools.
"""
