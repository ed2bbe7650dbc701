"""`python -m tessera_engine` and the tessera-engine command: the OpenMP settings and the
allocator first (it may re-execute the process with tcmalloc preloaded, see allocator.py), then
the server."""
import sys


def main() -> int:
    from tessera_engine import openmp_env
    from tessera_engine.allocator import preload

    openmp_env.apply()  # before torch is imported (and kept if preload re-executes the process)
    preload(sys.argv[1:])
    from tessera_engine.server import main as serve

    return serve()


if __name__ == "__main__":
    main()
