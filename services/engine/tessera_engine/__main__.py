"""`python -m tessera_engine` and the tessera-engine command: the allocator first (it may
re-execute the process with tcmalloc preloaded, see allocator.py), then the server."""
import sys


def main() -> int:
    from tessera_engine.allocator import preload

    preload(sys.argv[1:])
    from tessera_engine.server import main as serve

    return serve()


if __name__ == "__main__":
    main()
