"""Start the local stack (tokenizer, engine, frontend as three processes on the
default ports), stream one sample answer once all are SERVING, then keep serving
until Ctrl-C, which stops all three. Used by `make run`."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICES = [
    ("tokenizer", "tessera_tokenizer", os.environ.get("TESSERA_TOKENIZER_PORT", "50052")),
    ("engine", "tessera_engine", os.environ.get("TESSERA_ENGINE_PORT", "50053")),
    ("frontend", "tessera_frontend", os.environ.get("TESSERA_FRONTEND_PORT", "50051")),
]
QUESTION = os.environ.get("TESSERA_SAMPLE_QUESTION", "Why is the sky blue?")


def serving(port: str) -> bool:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def main() -> int:
    procs: list[subprocess.Popen] = []
    env = dict(os.environ)
    env.setdefault("TESSERA_TOKENIZER_ADDR", f"127.0.0.1:{SERVICES[0][2]}")
    env.setdefault("TESSERA_ENGINE_ADDRS", f"127.0.0.1:{SERVICES[1][2]}")
    # the children ignore Ctrl-C themselves; this script stops them in order
    for name, module, port in SERVICES:
        print(f"starting {name} on :{port}", file=sys.stderr)
        procs.append(subprocess.Popen([sys.executable, "-m", module, "--port", port], env=env,
                                      preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)))
    try:
        deadline = time.time() + 300
        while not all(serving(port) for _, _, port in SERVICES):
            for (name, _, _), p in zip(SERVICES, procs):
                if p.poll() is not None:
                    print(f"{name} exited with code {p.returncode}", file=sys.stderr)
                    return 1
            if time.time() > deadline:
                print("services did not become SERVING within 300 s", file=sys.stderr)
                return 1
            time.sleep(0.5)
        print(f"stack is SERVING; asking: {QUESTION}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "tessera.cli", "generate", QUESTION,
                        "--addr", f"127.0.0.1:{SERVICES[2][2]}", "--max-tokens", "128"], env=env)
        print(f"\nserving on localhost:{SERVICES[2][2]} (gRPC); Ctrl-C stops all three", file=sys.stderr)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        print("a service exited; stopping the stack", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping", file=sys.stderr)
        return 0
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
