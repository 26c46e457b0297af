"""The network benchmark's rate-limited link: a private network namespace whose loopback a ``tc`` qdisc limits
(:class:`Namespace`), tc rate strings, and whether this machine can make one (root, iproute2)."""

import os
import shutil
import signal
import subprocess
import sys

# the rate name of the link without a limit (the ceiling of what compression can win back)
UNLIMITED = "unlimited"


def parse_rate_bits(rate: str) -> float | None:
    """Bits per second of a tc rate string (``100mbit``, ``1gbit``, ``500kbit``, ``10mbit``); None if not one."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            try:
                value = float(rate[:-len(unit)])
            except ValueError:
                return None
            return value * scale if 0 < value < float("inf") else None
    return None


class Namespace:
    """A private network namespace with its loopback up; ``set_rate`` puts a tbf qdisc on it.

    Use as a context manager: the namespace is deleted on exit, also after an exception, Ctrl-C or
    SIGTERM (turned into SystemExit while it exists).
    """

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        self._old_term = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            subprocess.run(["ip", "-n", self.name, "link", "set", "lo", "up"], check=True)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        subprocess.run(["ip", "netns", "del", self.name], check=False)
        signal.signal(signal.SIGTERM, self._old_term)
        return False

    def set_rate(self, rate: str | None) -> None:
        """Limit the loopback to ``rate`` (tc syntax), or remove the limit when None."""
        subprocess.run(["tc", "-n", self.name, "qdisc", "del", "dev", "lo", "root"], check=False,
                       stderr=subprocess.DEVNULL)
        if rate is not None:
            subprocess.run(["tc", "-n", self.name, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
                            "burst", "128kb", "latency", "100ms"], check=True)

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]


def check_privileges() -> str | None:
    """Why the benchmark cannot create a rate-limited namespace here, or None if it can."""
    if os.geteuid() != 0:
        return "needs root (it creates a network namespace and a tc qdisc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} (iproute2) on PATH"
    return None
