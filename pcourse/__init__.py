"""pcourse: data-parallel training from scratch.

The package is what the notebooks build up and import; each module holds one idea:

- ``cluster``     start an MPI cluster of ipyparallel engines from a notebook
- ``rankinfo``    who am I in the MPI job, and which device do I own
- ``backends``    one small allreduce interface and the four real backends
- ``setup_check`` what works on this machine, in one table

Importing ``pcourse`` is cheap and never touches MPI or CUDA: engines and
notebooks import the submodules they need.
"""

__version__ = "0.1.0"
