"""`python -m tessera_engine` and the tessera-engine command: the allocator first (it may
re-execute the process with tcmalloc preloaded, see allocator.py), then the server."""
import os
import sys


def main() -> int:
    # The kernels run on their own thread pool (csrc/tile_queue.h), torch's own ops on its OpenMP
    # team; libgomp's idle threads spin 300,000 turns by default, long enough to keep the pool's
    # threads off the cores through a prompt step (measured: 38- and 63-row steps 40-60% slower).
    # Read by libgomp when torch loads it, so set before anything imports torch.
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    from tessera_engine.allocator import preload

    preload(sys.argv[1:])
    from tessera_engine.server import main as serve

    return serve()


if __name__ == "__main__":
    main()
