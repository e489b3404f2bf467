"""The runtime layer: what the taught code and the tools both stand on, and nothing else.

``ranks`` tells a process its rank and device (and picks a GPU per rank); ``waits``
makes every wait on a peer interruptible and bounded (one exception,
:class:`~pcourse.runtime.waits.CollectiveTimeout`); ``private`` reads the names torch,
ipyparallel and ipykernel do not promise to keep. No lesson shows this layer (what
they show is taught: ``agree``, ``backends.bootstrap``); nothing here imports the
lessons' modules or the tools.
"""
