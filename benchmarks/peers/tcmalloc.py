"""libtcmalloc_minimal.so.4 for a peer's LD_PRELOAD: the system's when installed, else Debian's
package fetched with `apt-get download libtcmalloc-minimal4` and unpacked (`dpkg -x`) into
<cache>/tcmalloc; None (glibc malloc) when neither is possible."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

from peers import log, run

SYSTEM_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4")


def ensure_tcmalloc(cache: pathlib.Path, skip_install: bool = False) -> str | None:
    """The library's path: the system's, else the unpacked package's (fetched once unless skip_install)."""
    for p in SYSTEM_PATHS:
        if os.path.exists(p):
            return p
    root = cache / "tcmalloc"
    found = sorted(root.glob("root/usr/lib/*/libtcmalloc_minimal.so.4"))
    if found:
        return str(found[0])
    if skip_install or not shutil.which("apt-get") or not shutil.which("dpkg"):
        log("  no tcmalloc (needs apt-get and dpkg to fetch it): the peer runs with glibc malloc")
        return None
    root.mkdir(parents=True, exist_ok=True)
    try:
        run(["apt-get", "download", "libtcmalloc-minimal4"], cwd=root, capture_output=True)
        debs = sorted(root.glob("libtcmalloc-minimal4_*.deb"))
        run(["dpkg", "-x", debs[-1], root / "root"])
    except (subprocess.CalledProcessError, IndexError) as e:
        log(f"  could not fetch tcmalloc ({e}): the peer runs with glibc malloc")
        return None
    found = sorted(root.glob("root/usr/lib/*/libtcmalloc_minimal.so.4"))
    return str(found[0]) if found else None
