"""Two nodes in the box: ranks of node A and node B reach each other only through a rate-limited path, node-mates
talk unlimited.

Inside a private network namespace (root), node A owns 127.0.1.1 and node B 127.0.2.1, each on an interface of its
own (``dgcA``, ``dgcB``: one end of a veth pair, whose other end stays unused) so that a gloo rank started with
``GLOO_SOCKET_IFNAME=dgcA`` listens on and advertises its node's address. A connection to a local address leaves
from that same address unless its socket is bound first, so the ranks also load ``benchmarks/bindsrc.c`` (built
with ``cc`` into a shared library, ``LD_PRELOAD``), which binds every socket that connects to 127.0.0.0/8 to its
node's address (``DGC_BIND_ADDR``): then every packet between the nodes carries one node's address as source and
the other's as destination. Local traffic always flows over the loopback, whichever interface holds the address, so the shaping
sits on ``lo``: an ``htb`` root sends A -> B and B -> A (``u32`` matches on the two /24 ranges) to a class each, shaped
to the rate, one per direction as on a full-duplex link; everything else (node-mates, the namespace's 127.0.0.1) is
unclassified and leaves unshaped. The two classes count the bytes that crossed between the nodes. Only addresses in
127.0.0.0/8 are used.

Usage (as root)::

    python -m benchmarks.two_nodes --rate 100mbit [--mbytes 8]   # set up, verify both directions and a node-mate
                                                                 # pair with plain sockets, print, tear down
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks import netlink  # the namespace, rate parsing and privilege check

NODE_ADDRESSES = {"A": "127.0.1.1", "B": "127.0.2.1"}
NODE_RANGES = {"A": "127.0.1.0/24", "B": "127.0.2.0/24"}
NODE_IFACES = {"A": "dgcA", "B": "dgcB"}
# htb classes of the two directions; unclassified traffic (node-mates) is sent directly, unshaped
SHAPED_CLASSES = {("A", "B"): "1:20", ("B", "A"): "1:30"}

# A receiver bound to one address and a sender bound to another, in one process: the seconds to move n bytes.
TRANSFER = """
import socket, sys, threading, time
src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
server = socket.socket(); server.bind((dst, 0)); server.listen()
got = []
def receive():
    conn, _ = server.accept(); total = 0
    while True:
        data = conn.recv(1 << 20)
        if not data:
            break
        total += len(data)
    got.append(total)
t = threading.Thread(target=receive); t.start()
client = socket.socket(); client.bind((src, 0)); client.connect(server.getsockname())
start = time.perf_counter(); client.sendall(b"x" * n); client.shutdown(socket.SHUT_WR); t.join()
print(time.perf_counter() - start, got[0])
"""


# One gloo rank of a 2-rank group (rank 0 on node A, rank 1 on node B): all-reduce of n fp32 values; rank 0 prints
# the seconds.
GLOO_RANK = """
import sys, time, datetime, torch, torch.distributed as dist
rank, port, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.1.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
x = torch.ones(n)
dist.all_reduce(torch.ones(16))
start = time.perf_counter(); dist.all_reduce(x); seconds = time.perf_counter() - start
assert bool((x == 2).all())
dist.destroy_process_group()
if rank == 0:
    print(seconds)
"""


def check_privileges() -> Optional[str]:
    """Why two nodes cannot be made here, or None if they can: a namespace's needs (root, iproute2) and ``cc``."""
    why = netlink.check_privileges()
    if why is None and shutil.which("cc") is None:
        why = "needs cc on PATH (it builds benchmarks/bindsrc.c)"
    return why


SHIM_SOURCE = Path(__file__).resolve().parent / "bindsrc.c"


def build_shim(out_dir: str) -> str:
    """Compile ``bindsrc.c`` into ``out_dir``; the library's path.

    Raises:
        RuntimeError: the compiler failed.
    """
    lib = os.path.join(out_dir, "libbindsrc.so")
    proc = subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", lib, str(SHIM_SOURCE), "-ldl"], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building {SHIM_SOURCE.name} failed: {proc.stderr.strip()[-800:]}")
    return lib


def parse_rate_bits(rate: str) -> float:
    """Bits per second of a tc rate (``100mbit``, ``1gbit``, ``500kbit``): :func:`netlink.parse_rate_bits`.

    Raises:
        ValueError: not such a rate.
    """
    bits = netlink.parse_rate_bits(rate)
    if bits is None:
        raise ValueError(f"{rate!r} is not a tc rate like 100mbit, 1gbit or 500kbit")
    return bits


@dataclass
class Transfer:
    """One plain socket transfer: ``src`` -> ``dst`` addresses, bytes, seconds, and the rate it reached (bits/s)."""
    src: str
    dst: str
    nbytes: int
    seconds: float

    @property
    def bits_per_s(self) -> float:
        return 8 * self.nbytes / self.seconds


class TwoNodeLink(netlink.Namespace):
    """A namespace holding two nodes whose only path between them is shaped to ``rate`` in each direction.

    Args:
        rate: tc rate of the inter-node path in each direction (``"100mbit"``), or None: unshaped.
        name: the namespace's name (a fresh one by default).

    Use as a context manager: the namespace (and with it every interface and qdisc) is deleted on exit, also after
    an exception or SIGTERM.

    Raises:
        ValueError: ``rate`` is not a tc rate.
        subprocess.CalledProcessError: an ``ip``/``tc`` command failed (not root, no iproute2).
    """

    def __init__(self, rate: Optional[str], name: Optional[str] = None):
        if rate is not None:
            parse_rate_bits(rate)
        super().__init__(name or f"dgc2n-{uuid.uuid4().hex[:8]}")
        self.rate = rate

    def _run(self, *cmd: str) -> None:
        subprocess.run(list(cmd), check=True, capture_output=True, text=True)

    def __enter__(self) -> "TwoNodeLink":
        self._tmp = tempfile.TemporaryDirectory(prefix="dgc2n-")
        self.shim = build_shim(self._tmp.name)
        try:
            super().__enter__()  # the namespace, its loopback up, SIGTERM -> exit
        except BaseException:
            self._tmp.cleanup()
            raise
        try:
            for node, iface in NODE_IFACES.items():
                self._run("ip", "-n", self.name, "link", "add", iface, "type", "veth", "peer", "name", iface + "p")
                self._run("ip", "-n", self.name, "addr", "add", f"{NODE_ADDRESSES[node]}/32", "dev", iface)
                for end in (iface, iface + "p"):
                    self._run("ip", "-n", self.name, "link", "set", end, "up")
            self.set_rate(self.rate)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> bool:
        super().__exit__(*exc)
        self._tmp.cleanup()
        return False

    def set_rate(self, rate: Optional[str]) -> None:
        """Shape each direction between the nodes to ``rate`` (None: remove the shaping)."""
        subprocess.run(["tc", "-n", self.name, "qdisc", "del", "dev", "lo", "root"], check=False, capture_output=True)
        self.rate = rate
        if rate is None:
            return
        parse_rate_bits(rate)
        tc = ["tc", "-n", self.name]
        self._run(*tc, "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "0")
        for (a, b), classid in SHAPED_CLASSES.items():
            self._run(*tc, "class", "add", "dev", "lo", "parent", "1:", "classid", classid, "htb", "rate", rate,
                      "ceil", rate, "burst", "128kb", "cburst", "128kb", "quantum", "65536")
            self._run(*tc, "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                      "match", "ip", "src", NODE_RANGES[a], "match", "ip", "dst", NODE_RANGES[b], "flowid", classid)

    def inter_node_bytes(self) -> Dict[str, int]:
        """Bytes the shaping classes have sent so far, per direction (``"A->B"``, ``"B->A"``); zeros when unshaped."""
        out = {f"{a}->{b}": 0 for a, b in SHAPED_CLASSES}
        if self.rate is None:
            return out
        # the main job's reading of the classes' counters; imported here, as it imports torch and deepspeed, which
        # setting up the link does not need
        from examples.train_char_gpt import tc_class_bytes
        sent = tc_class_bytes(list(SHAPED_CLASSES.values()), "lo", self.name)
        return {f"{a}->{b}": sent[c] for (a, b), c in SHAPED_CLASSES.items()}

    def node_env(self, node: str) -> Dict[str, str]:
        """Environment of a rank on ``node`` (``"A"`` or ``"B"``): gloo listens on that node's address, and its
        connections leave from it."""
        preload = " ".join(p for p in (self.shim, os.environ.get("LD_PRELOAD", "")) if p)
        return {"GLOO_SOCKET_IFNAME": NODE_IFACES[node], "DGC_BIND_ADDR": NODE_ADDRESSES[node], "LD_PRELOAD": preload}

    def transfer(self, src: str, dst: str, nbytes: int, timeout_s: float = 120.0) -> Transfer:
        """Move ``nbytes`` over TCP from address ``src`` to ``dst`` inside the namespace.

        Raises:
            RuntimeError: the transfer failed or the receiver got another byte count.
        """
        proc = subprocess.run(self.prefix() + [sys.executable, "-c", TRANSFER, src, dst, str(nbytes)],
                              capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"transfer {src} -> {dst} failed: {proc.stderr.strip()[-500:]}")
        seconds, got = proc.stdout.split()
        if int(got) != nbytes:
            raise RuntimeError(f"transfer {src} -> {dst}: sent {nbytes} bytes, received {got}")
        return Transfer(src, dst, nbytes, float(seconds))

    def verify_gloo(self, nbytes: int = 8 << 20, nodes=("A", "B"), port: int = 29611,
                    timeout_s: float = 120.0) -> Dict[str, float]:
        """A gloo all-reduce of ``nbytes`` between a rank on ``nodes[0]`` and one on ``nodes[1]`` (each bound to its
        node's address through :meth:`node_env`; the store on node A): its seconds and the bytes the shaping classes
        counted meanwhile (``"A->B"``, ``"B->A"``).

        Raises:
            RuntimeError: a rank failed.
        """
        before = self.inter_node_bytes()
        procs = [subprocess.Popen(self.prefix() + [sys.executable, "-c", GLOO_RANK, str(rank), str(port),
                                                   str(nbytes // 4)],
                                  env=dict(os.environ, **self.node_env(node)), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for rank, node in enumerate(nodes)]
        outs = [p.communicate(timeout=timeout_s) for p in procs]
        for p, (_, err) in zip(procs, outs):
            if p.returncode != 0:
                raise RuntimeError(f"gloo rank failed: {err.strip()[-800:]}")
        after = self.inter_node_bytes()
        result = {k: float(after[k] - before[k]) for k in after}
        result["seconds"] = float(outs[0][0].split()[-1])
        return result

    def verify(self, nbytes: int = 8 << 20) -> List[Transfer]:
        """Plain socket transfers A -> B, B -> A and A -> A (node-mates: 127.0.1.1 -> 127.0.1.2)."""
        a, b = NODE_ADDRESSES["A"], NODE_ADDRESSES["B"]
        return [self.transfer(a, b, nbytes), self.transfer(b, a, nbytes), self.transfer(a, "127.0.1.2", nbytes)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="100mbit", help="tc rate between the nodes, each direction")
    ap.add_argument("--mbytes", type=float, default=8.0, help="megabytes per verification transfer")
    args = ap.parse_args(argv)
    why = check_privileges()
    if why:
        print(f"two_nodes: {why}", file=sys.stderr)
        return 2
    try:
        limit = parse_rate_bits(args.rate)
    except ValueError as err:
        ap.error(f"--rate: {err}")
    with TwoNodeLink(args.rate) as link:
        before = link.inter_node_bytes()
        start = time.perf_counter()
        transfers = link.verify(int(args.mbytes * 1e6))
        after = link.inter_node_bytes()
        print(f"# two nodes, {args.rate} each direction between 127.0.1.0/24 and 127.0.2.0/24 "
              f"({time.perf_counter() - start:.1f} s)")
        print("| transfer | MB | seconds | Mbit/s | of the limit |")
        print("|---|---:|---:|---:|---:|")
        for t in transfers:
            print(f"| {t.src} -> {t.dst} | {t.nbytes / 1e6:.1f} | {t.seconds:.3f} | {t.bits_per_s / 1e6:.1f} | "
                  f"{t.bits_per_s / limit:.2f}x |")
        print("bytes counted by the shaping classes: " +
              ", ".join(f"{k} {after[k] - before[k]:,}" for k in after))
        for nodes in (("A", "B"), ("A", "A")):
            gloo = link.verify_gloo(int(args.mbytes * 1e6), nodes)
            print(f"gloo all-reduce of {args.mbytes:g} MB, ranks on nodes {nodes[0]} and {nodes[1]}: "
                  f"{gloo['seconds']:.3f} s; shaped bytes A->B {gloo['A->B']:,.0f}, B->A {gloo['B->A']:,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
