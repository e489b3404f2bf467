"""What works on this machine: ``setup_check`` (lesson 00, every backend and engine)
and ``gpu_check`` (both NCCL backends on the GPUs, against MPI's own Allreduce)."""
