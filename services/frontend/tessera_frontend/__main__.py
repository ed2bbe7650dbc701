"""`python -m tessera_frontend` runs the frontend server."""
from tessera_frontend.server import main

if __name__ == "__main__":
    main()
