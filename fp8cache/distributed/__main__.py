"""`python -m fp8cache.distributed SPEC`: a worker rank started by an offline tensor-parallel group."""

import sys

from fp8cache.distributed import parallel_state
from fp8cache.distributed.group import worker_main

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m fp8cache.distributed SPEC_JSON (TensorParallelGroup starts it)")
    parallel_state.exit_rank(worker_main(sys.argv[1]))
