#!/usr/bin/env bash
# Put the CPU torch wheel for the engine image into docker/wheels/ (inside the build
# context), taken from what this machine's pip finds WITHOUT an index: its find-links
# (pip config, PIP_FIND_LINKS) or its cache. The wheel must fit the image: CPython 3.11,
# manylinux x86_64. If none is found, nothing is staged and the engine Dockerfile asks
# the PyTorch CPU index (TORCH_CPU_INDEX) itself. Always exits 0 unless pip is missing.
#
#   docker/stage-torch-wheel.sh [VERSION]     (default: the torch pin of requirements.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-pip}
version=${1:-$(sed -n 's/^torch==\([^ #;]*\).*/\1/p' requirements.txt | head -n1)}
version=${version:-2.13.0}
dest=docker/wheels

if compgen -G "$dest/torch-$version+cpu-cp311-*.whl" >/dev/null; then
    echo "stage-torch-wheel: $(basename "$dest"/torch-"$version"+cpu-cp311-*.whl) already staged" >&2
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if $PIP download --quiet --no-index --no-deps --only-binary=:all: \
        --python-version 3.11 --implementation cp --abi cp311 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$tmp" "torch==$version" 2>"$tmp/err" \
   && compgen -G "$tmp/torch-$version+cpu-*.whl" >/dev/null; then
    mv "$tmp"/torch-"$version"+cpu-*.whl "$dest/"
    echo "stage-torch-wheel: staged $(basename "$dest"/torch-"$version"+cpu-*.whl)" >&2
else
    echo "stage-torch-wheel: no local CPU wheel of torch $version; the build will use TORCH_CPU_INDEX" >&2
fi
