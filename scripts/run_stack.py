"""`make run`: `tessera serve` (the three services as local processes, stopped with their drain
on Ctrl-C) plus one streamed sample answer once the stack is SERVING. Flags are serve's.

On a terminal it shows the model loading, the endpoints and the answer; the services' logs
stay in a file. A service that exits (a model that can never be served ends the engine)
ends the run with status 1 and the reason, naming the model (tessera.serve)."""
from __future__ import annotations

import os
import subprocess
import sys

from tessera import serve

QUESTION = os.environ.get("TESSERA_SAMPLE_QUESTION", "Why is the sky blue?")


def ask(addr: str) -> None:
    print(f"asking: {QUESTION}", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "tessera.cli", "generate", QUESTION, "--addr", addr,
                    "--max-tokens", "128"])


if __name__ == "__main__":
    sys.exit(serve.main(sys.argv[1:], on_serving=ask))
