#!/usr/bin/env bash
# Make the base image the service Dockerfiles build FROM, without pulling anything:
# a Debian bookworm minbase root filesystem made by debootstrap, with python3,
# python3-venv and python3-pip, imported with `docker import` and tagged.
#
#   docker/build-base.sh [TAG]          (default tag: tessera-base:bookworm)
#
# Use it where no registry can be reached; elsewhere the Dockerfiles' default
# BASE_IMAGE (python:3.11-slim-bookworm) is pulled as usual. Then build with
#   --build-arg BASE_IMAGE=tessera-base:bookworm   (or TESSERA_BASE_IMAGE=... for compose)
#
# The root filesystem is cached as a tarball under $TESSERA_CONTAINER_CACHE
# (default /var/cache/tessera-containers), keyed by the package list and mirror,
# so a second run only re-imports it (seconds instead of a debootstrap).
# Certificate authorities the host trusts locally (/usr/local/share/ca-certificates)
# are added to the image's bundle: pip inside the builds then reaches PyPI through
# the same TLS-inspecting egress the host uses. Needs root, debootstrap and DOCKER_HOST.
set -euo pipefail

TAG=${1:-tessera-base:bookworm}
SUITE=${TESSERA_BASE_SUITE:-bookworm}
MIRROR=${TESSERA_DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=python3,python3-venv,python3-pip,ca-certificates,passwd
CACHE=${TESSERA_CONTAINER_CACHE:-/var/cache/tessera-containers}

key=$(printf '%s\n' "$SUITE" "$MIRROR" "$PACKAGES" "$(sha256sum "$0" | cut -c1-16)" \
      "$(cat /usr/local/share/ca-certificates/*.crt 2>/dev/null | sha256sum | cut -c1-16)" \
      | sha256sum | cut -c1-16)
tarball="$CACHE/base-$SUITE-$key.tar"

if [[ ! -s $tarball ]]; then
    command -v debootstrap >/dev/null || { echo "build-base: debootstrap is not installed" >&2; exit 1; }
    mkdir -p "$CACHE"
    rootfs=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    trap 'rm -rf "$rootfs" "$tarball.part"' EXIT
    echo "build-base: debootstrap $SUITE (minbase + $PACKAGES) into $rootfs" >&2
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 \
        || { tail -n 30 "$rootfs.log" >&2; rm -f "$rootfs.log"; exit 1; }
    rm -f "$rootfs.log"
    if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
        cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
        chroot "$rootfs" update-ca-certificates >/dev/null
    fi
    # What a slim image leaves out: package caches and lists, docs, man pages, locales.
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
           "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
           "$rootfs"/usr/share/locale/* "$rootfs"/var/log/*.log "$rootfs"/tmp/*
    tar --numeric-owner -C "$rootfs" -cf "$tarball.part" .
    mv "$tarball.part" "$tarball"
    # Older tarballs (other keys) are stale.
    find "$CACHE" -maxdepth 1 -name "base-$SUITE-*.tar" ! -path "$tarball" -delete
fi

echo "build-base: importing $tarball as $TAG" >&2
docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' \
    "$tarball" "$TAG" >/dev/null
echo "build-base: $TAG ready" >&2
