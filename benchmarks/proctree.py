"""Memory and CPU of a server's process trees while it is measured (psutil): the peak summed RSS
of groups of trees, sampled on a thread, and the CPU seconds of the server, of this client and
of everything else over a block."""
from __future__ import annotations

import threading
import time


def tree(pids: list[int]) -> list:
    """psutil handles of these processes and all their descendants (those alive now)."""
    import psutil

    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs.append(p)
            procs.extend(p.children(recursive=True))
        except psutil.Error:
            pass
    return procs


class RssSampler:
    """Peak summed RSS of groups of process trees, sampled every interval_s on a thread.

    The trees are walked again only every resolve_s: a walk reads every process of the machine,
    and walking each group's tree at every sample cost this client CPU in proportion to the
    server's process count (tessera's two groups of three processes cost several times vLLM's
    one), CPU taken from the server under test. Between walks each sample reads the known
    processes' RSS."""

    def __init__(self, groups: dict[str, list[int]], interval_s: float = 0.05, resolve_s: float = 1.0) -> None:
        self.groups = groups
        self.interval_s = interval_s
        self.resolve_s = resolve_s
        self.life_peak = {g: 0.0 for g in groups}
        self.window_peak = {g: 0.0 for g in groups}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import psutil

        trees: dict[str, list] = {}
        walked = float("-inf")
        while not self._stop.wait(self.interval_s):
            if time.monotonic() - walked >= self.resolve_s:
                trees = {g: tree(pids) for g, pids in self.groups.items()}
                walked = time.monotonic()
            for g, procs in trees.items():
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                mib = total / (1 << 20)
                self.life_peak[g] = max(self.life_peak[g], mib)
                self.window_peak[g] = max(self.window_peak[g], mib)

    def start_window(self) -> None:
        """Start a new window: window_peak counts from now."""
        self.window_peak = {g: 0.0 for g in self.groups}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _cpu_s(procs) -> float:
    import psutil

    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


class CpuWindow:
    """CPU seconds of the server's processes, of this client, and of everything else, over a block:
    `result` = {"server_cpu_s", "client_cpu_s", "foreign_cores"}."""

    def __init__(self, server_pids: list[int]) -> None:
        self.server_pids = server_pids

    def __enter__(self):
        import psutil

        self._procs = tree(self.server_pids)
        self._server0 = _cpu_s(self._procs)
        self._own0 = _cpu_s([psutil.Process()])
        t = psutil.cpu_times()
        self._busy0 = sum(t) - t.idle - getattr(t, "iowait", 0.0)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import psutil

        wall = time.perf_counter() - self._t0
        server = _cpu_s(self._procs) - self._server0
        own = _cpu_s([psutil.Process()]) - self._own0
        t = psutil.cpu_times()
        busy = sum(t) - t.idle - getattr(t, "iowait", 0.0) - self._busy0
        self.result = {"server_cpu_s": server, "client_cpu_s": own,
                       "foreign_cores": max(0.0, busy - server - own) / wall if wall > 0 else None}
        return False
