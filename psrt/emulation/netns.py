"""Several hosts on one machine: Linux network namespaces joined by veth pairs to a bridge.

Each host is a namespace with its own address on a private subnet that exists only inside these namespaces;
its link can be shaped in both directions with ``tc ... tbf`` (one qdisc on each end of its veth pair), which
emulates a cluster whose hosts have a given NIC bandwidth; hosts can have links of their own rates, or none
(``links``), and the links can be a lossless network for many peers on one host (``queueing="fifo"``,
``lossless``, ``tcp_window``). Used by the multi-host tests and the scaling
benchmark. Needs root and iproute2.

Each host also has a /dev/shm of its own (a directory of the machine's /dev/shm, bind-mounted over /dev/shm in
the private mount namespace of every process started on that host), so processes on one emulated host share
memory as on a real one, and processes on two do not: shared-memory lanes (:mod:`psrt.shm.lanes`) between emulated
hosts would bypass the links being emulated.

Every name carries the creating process's pid (``psrt<pid>-<host>``, bridge ``psbr<pid><letter>``), so a run that
crashed before cleaning up is recognised and removed by the next one (:func:`remove_leftovers`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
from typing import Any, Mapping, Optional, Sequence

from psrt.control.process import Child, pid_alive, popen, stop_children, stop_processes
from psrt.errors import ConfigError, PsrtError

__all__ = ["VirtualCluster", "remove_leftovers", "parse_rate", "burst_for", "check_available"]

_NS = re.compile(r"^psrt(\d+)-[A-Za-z0-9_.-]+$")
_BR = re.compile(r"^psbr(\d+)[a-z]$")
_SHM = re.compile(r"^psrt(\d+)[a-z]-[A-Za-z0-9_.-]+\.shm$")
#: Where each emulated host's /dev/shm lives.
SHM_ROOT = "/dev/shm"
#: Clusters made by this process so far: each one's link names differ, since the kernel removes a deleted
#: namespace's veth pair only after ``ip netns del`` returns, and a new cluster must not collide with it.
_made = 0
#: Clusters alive in this process that took SIGTERM over (:func:`_take_sigterm`), and the handler before them.
_sigterm_takers = 0
_sigterm_before: Any = None
#: The data queue of a link shaped with ``queueing="fifo"``, in bytes: deep, so that many peers sending into one
#: host at once queue rather than lose packets.
QUEUE_BYTES = 64 << 20
#: TCP's least retransmission timeout on the hosts of a ``lossless`` cluster (seconds).
LOSSLESS_RTO_MIN = 15
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def _interrupted(signum: int, frame: Any) -> None:
    if _sigterm_takers == 0:
        # The last cluster was closed from another thread, which cannot set a handler: SIGTERM does what it did
        # before the clusters took it (its default: this process ends), from here on too.
        signal.signal(signal.SIGTERM, _sigterm_before)
        signal.raise_signal(signum)
        return
    raise KeyboardInterrupt(f"signal {signum}")


def _take_sigterm() -> bool:
    """While clusters live, SIGTERM unwinds the main thread as Ctrl-C does, so that their ``close`` runs (the
    children die with this process anyway, but namespaces, bridge and /dev/shm directories would stay until the
    next cluster removed them). Only where SIGTERM has its default action and from the main thread: a program's
    own handler is left alone. Returns whether this cluster counts among the takers."""
    global _sigterm_takers, _sigterm_before
    if threading.current_thread() is not threading.main_thread():
        return False
    if _sigterm_takers == 0:
        handler = signal.getsignal(signal.SIGTERM)
        if handler is not _interrupted:  # (ours still: given back from another thread, see _give_sigterm_back)
            if handler is not signal.SIG_DFL:
                return False
            _sigterm_before = signal.signal(signal.SIGTERM, _interrupted)
    _sigterm_takers += 1
    return True


def _give_sigterm_back() -> None:
    """One taker fewer; the last gives SIGTERM its action back. Only the main thread may set a handler: from another
    thread the handler stays, and does what SIGTERM did before when it comes (:func:`_interrupted`)."""
    global _sigterm_takers
    _sigterm_takers -= 1
    if _sigterm_takers == 0 and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _sigterm_before)


def burst_for(rate_bits: Optional[int]) -> int:
    """The token-bucket burst of a link shaped to ``rate_bits`` (0 for an unshaped one), in bytes.

    1 ms of traffic, and at least 128 KiB so a 64 KiB GSO packet passes whole (a smaller bucket makes tbf cut
    every such packet into MTU-sized ones, which costs more CPU than the data it moves).
    """
    return max(int(rate_bits / 8 / 1000), 128 * 1024) if rate_bits else 0


def parse_rate(rate: str) -> int:
    """Bits per second of a tc-style rate such as ``1gbit``, ``500mbit`` or ``100kbit``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?bit)\s*", rate.lower())
    if not m:
        raise ConfigError(f"link rate {rate!r} is not a rate such as 1gbit, 500mbit or 100kbit")
    bits = int(float(m.group(1)) * _UNITS[m.group(2)])
    if bits <= 0:
        raise ConfigError(f"link rate {rate!r} must be positive")
    return bits


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise PsrtError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def check_available() -> None:
    """Raise :class:`ConfigError` saying what is missing unless we are root with iproute2 installed."""
    if os.geteuid() != 0:
        raise ConfigError("an emulated cluster needs root (network namespaces, veth, bridges, tc): run as root, "
                          "or use plain loopback instead")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            raise ConfigError(f"`{tool}` not found: install {package} (apt-get install {package})")


def remove_leftovers() -> list[str]:
    """Delete namespaces and bridges left by psrt runs whose process is gone; returns what was removed."""
    removed = []
    listing = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listing:
        name = line.split(" ")[0].strip()
        m = _NS.match(name)
        if m and not pid_alive(int(m.group(1))):
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        parts = line.split(":")
        name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        m = _BR.match(name)
        if m and not pid_alive(int(m.group(1))):
            _ip("link", "del", name, check=False)
            removed.append(name)
    for name in os.listdir(SHM_ROOT) if os.path.isdir(SHM_ROOT) else []:
        m = _SHM.match(name)
        if m and not pid_alive(int(m.group(1))):
            shutil.rmtree(os.path.join(SHM_ROOT, name), ignore_errors=True)
            removed.append(name)
    return removed


class VirtualCluster:
    """Hosts in network namespaces on one bridge, optionally with shaped links.

    Parameters
    ----------
    hosts : sequence of str
        Host names (letters, digits, ``_.-``); each gets a namespace and an address.
    link : str, optional
        Bandwidth of every host's link in each direction, e.g. ``"1gbit"``; unshaped when None.
    links : mapping of str to (str or None), optional
        Hosts whose link differs from ``link``: each one's rate, or None for an unshaped link (a cluster whose
        only narrow links are some hosts', as a shard's NIC in a data centre whose workers' NICs are faster).
    subnet : int, optional
        Third octet of the private ``10.213.N.0/24`` subnet (default: derived from the pid).
    queueing : str
        How a shaped link queues: ``"tbf"`` (default), one ``tbf`` queue for everything, first in first out, 1 s
        deep (a busy link's bare TCP acknowledgements then wait behind the other direction's data, and TCP reaches
        ~90 % of the rate both ways); ``"fifo"``, ``htb`` with TCP's bare acknowledgements first, as a data-centre
        network's priority for control traffic, and then the data in one deep first-in-first-out queue
        (:data:`QUEUE_BYTES`), where nothing is lost.
    tcp_window : int, optional
        The most bytes a TCP peer may have in flight to any host (the window every host advertises, ``ip route
        ... window``). The shaped links' queues are deep so that nothing is lost, and with W peers sending to one
        host its link's queue then holds at most W windows, not all their data: each peer's waiting bytes stay in
        its own socket, and no message waits there behind seconds of other peers' data (as a data centre's
        switch buffers hold milliseconds, not seconds). By default TCP's own autotuned windows.
    lossless : bool
        A network that loses and reorders nothing, as one with the deep queues of ``fifo`` links does:
        each veth end steers a flow's packets to one CPU (RPS; without it a flow whose sender moves between CPUs
        can overtake itself, which TCP takes for loss and repairs by sending data again), and every host's TCP has
        no tail loss probes (``tcp_early_retrans=0``) and a least retransmission timeout of
        :data:`LOSSLESS_RTO_MIN` seconds (``ip route ... rto_min``). Many peers sending into one link at once take
        its queueing delay from nothing to seconds within a round trip, faster than TCP's estimate follows; the
        kernel's 200 ms timeout and its probes then resend, spuriously, data still in the queue, and the copies
        take link time.

    While a cluster lives, SIGTERM to its process (from the main thread's view, where SIGTERM had its default
    action) raises KeyboardInterrupt, as Ctrl-C does, so that ``with`` blocks remove the namespaces on the way out.

    Examples
    --------
    >>> with VirtualCluster(["a", "b"], link="1gbit") as vc:   # doctest: +SKIP
    ...     vc.run("a", ["ping", "-c1", vc.address("b")])
    """

    def __init__(self, hosts: Sequence[str], link: Optional[str] = None, subnet: Optional[int] = None,
                 links: Optional[Mapping[str, Optional[str]]] = None, queueing: str = "tbf",
                 tcp_window: Optional[int] = None, lossless: bool = False) -> None:
        check_available()
        if not hosts or len(hosts) > 250 or len(set(hosts)) != len(hosts):
            raise ConfigError("hosts must be 1 to 250 distinct names")
        for h in hosts:
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,20}", h):
                raise ConfigError(f"host name {h!r} may only use letters, digits and _.- (at most 20)")
        unknown = sorted(set(links or ()) - set(hosts))
        if unknown:
            raise ConfigError(f"links names hosts that are not in the cluster: {', '.join(unknown)}")
        self.rate_bits = parse_rate(link) if link else None
        self.burst_bytes = burst_for(self.rate_bits)
        self.hosts = list(hosts)
        if queueing not in ("tbf", "fifo"):
            raise ConfigError(f"queueing must be tbf or fifo, got {queueing!r}")
        self.queueing = queueing
        if tcp_window is not None and (isinstance(tcp_window, bool) or not isinstance(tcp_window, int)
                                       or tcp_window < 4096):
            raise ConfigError(f"tcp_window must be a whole number of bytes >= 4096, got {tcp_window!r}")
        self.tcp_window = tcp_window
        self.lossless = lossless
        #: Each host's link rate in bits/s (None: unshaped).
        self.rates: dict[str, Optional[int]] = {h: self.rate_bits for h in self.hosts}
        for h, rate in (links or {}).items():
            self.rates[h] = parse_rate(rate) if rate else None
        self.pid = os.getpid()
        self.subnet = subnet if subnet is not None else 10 + self.pid % 240
        global _made
        self._tag = "abcdefghijklmnopqrstuvwxyz"[_made % 26]
        _made += 1
        self.bridge = f"psbr{self.pid}{self._tag}"
        self._procs: list[subprocess.Popen] = []
        self._children: list[Child] = []
        self._created_ns: list[str] = []
        self._shm: dict[str, str] = {}  # host -> the directory that is its /dev/shm
        self._bridge_made = False
        remove_leftovers()
        self._took_sigterm = _take_sigterm()
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def veth(self, host: str) -> str:
        """The outer end (in the root namespace, on the bridge) of ``host``'s veth pair: cut it to cut the host off."""
        return f"pv{self.pid}{self._tag}{self.hosts.index(host)}"

    def namespace(self, host: str) -> str:
        """The namespace name of ``host``."""
        return f"psrt{self.pid}-{host}"

    def address(self, host: str) -> str:
        """The IPv4 address of ``host``."""
        return f"10.213.{self.subnet}.{self.hosts.index(host) + 1}"

    def mac(self, host: str) -> str:
        """The hardware address of ``host``'s interface (locally administered, unique in this cluster)."""
        index = self.hosts.index(host) + 1
        return f"02:13:{self.subnet:02x}:00:{index >> 8:02x}:{index & 0xff:02x}"

    def _ip_batch(self, ns: str, commands: list[list[str]]) -> None:
        """Run ``ip`` commands inside ``ns``, all in one ``ip -batch``."""
        if not commands:
            return
        proc = subprocess.run(["ip", "-n", ns, "-batch", "-"], input="\n".join(" ".join(c) for c in commands) + "\n",
                              capture_output=True, text=True, timeout=120)
        if proc.returncode:
            raise PsrtError(f"`ip -n {ns} -batch` failed: {proc.stderr.strip()}")

    def burst_of(self, host: str) -> int:
        """The token-bucket burst of ``host``'s link in bytes (0 when it is unshaped)."""
        return burst_for(self.rates[host])

    def _tbf(self, rate_bits: int) -> list[str]:
        burst = burst_for(rate_bits)  # the performance model counts it (Scenario.burst_bytes)
        # A deep queue (1 s of traffic): W workers pushing to one server at once must queue, not drop, or TCP
        # retransmission timeouts would dominate what we measure.
        return ["tbf", "rate", f"{rate_bits}bit", "burst", str(burst), "latency", "1s"]

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._bridge_made = True
        _ip("link", "set", self.bridge, "up")
        for i, host in enumerate(self.hosts):
            ns = self.namespace(host)
            self._shm[host] = os.path.join(SHM_ROOT, f"psrt{self.pid}{self._tag}-{host}.shm")
            os.mkdir(self._shm[host], 0o1777)
            os.chmod(self._shm[host], 0o1777)  # as /dev/shm itself (the umask would narrow mkdir's mode)
            outer, inner = self.veth(host), f"pn{self.pid}{self._tag}{i}"
            _ip("netns", "add", ns)
            self._created_ns.append(ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner, "address", self.mac(host))
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", ns, "link", "set", inner, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            route = (["window", str(self.tcp_window)] if self.tcp_window else []) + (
                ["rto_min", f"{LOSSLESS_RTO_MIN}s"] if self.lossless else [])
            if route:
                _ip("-n", ns, "route", "change", f"10.213.{self.subnet}.0/24", "dev", "eth0", "proto", "kernel",
                    "scope", "link", "src", self.address(host), *route)
            # Keep TCP's window across the idle compute phase of a step, as tuned data-centre hosts do;
            # otherwise every step would restart in slow start and the round-trip time would dominate.
            subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.tcp_slow_start_after_idle=0",
                            *(["net.ipv4.tcp_early_retrans=0"] if self.lossless else [])],
                           capture_output=True, timeout=30)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            if self.lossless:
                cpus = f"{(1 << (os.cpu_count() or 1)) - 1:x}"
                with open(f"/sys/class/net/{outer}/queues/rx-0/rps_cpus", "w") as f:
                    f.write(cpus)
                subprocess.run(["ip", "netns", "exec", ns, "sh", "-c",
                                f"echo {cpus} > /sys/class/net/eth0/queues/rx-0/rps_cpus"], capture_output=True,
                               timeout=30, check=True)
            rate = self.rates[host]
            if rate:
                # The outer end sends into the host, eth0 out of it.
                for dev, prefix in ((outer, []), ("eth0", ["ip", "netns", "exec", ns])):
                    self._tc(prefix, self._shaping(dev, rate))
        # Every host knows every other's hardware address: the kernel's neighbour table is one for all namespaces,
        # 1,024 entries by default (gc_thresh3), and a cluster of N hosts learning each other's by ARP needs up to
        # N x (N - 1); past the limit new entries are refused, and a host that came late reaches no one (49 hosts
        # did: ARP failed for minutes, and the job never formed). Permanent entries are exempt from that limit, and
        # no ARP request then waits behind seconds of data in a shaped link's queue.
        for host in self.hosts:
            self._ip_batch(self.namespace(host), [
                ["neigh", "replace", self.address(other), "lladdr", self.mac(other), "dev", "eth0", "nud", "permanent"]
                for other in self.hosts if other != host])

    def dropped(self, host: str) -> int:
        """Packets ``host``'s shaped link has dropped so far, both directions (0 when it is unshaped)."""
        if not self.rates[host]:
            return 0
        total = 0
        for args in (["tc", "-s", "qdisc", "show", "dev", self.veth(host)],
                     ["ip", "netns", "exec", self.namespace(host), "tc", "-s", "qdisc", "show", "dev", "eth0"]):
            out = subprocess.run(args, capture_output=True, text=True, timeout=30).stdout
            # Every qdisc's own drops (htb's root and its leaf queue each count theirs).
            total += sum(int(n) for n in re.findall(r"\(dropped (\d+),", out))
        return total

    def retransmitted(self, host: str) -> int:
        """TCP segments ``host`` has sent again so far (``TcpRetransSegs`` of its namespace)."""
        out = self.run(host, ["cat", "/proc/net/snmp"]).stdout.splitlines()
        for names, values in zip(out, out[1:]):
            if names.startswith("Tcp:") and values.startswith("Tcp:"):
                row = dict(zip(names.split()[1:], values.split()[1:]))
                if "RetransSegs" in row:
                    return int(row["RetransSegs"])
        return 0

    def _tc(self, prefix: list[str], commands: list[list[str]]) -> None:
        """Run tc commands (one ``tc -batch`` for many)."""
        if len(commands) == 1:
            args = [*prefix, "tc", *commands[0]]
            proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
        else:
            args = [*prefix, "tc", "-batch", "-"]
            proc = subprocess.run(args, input="\n".join(" ".join(c) for c in commands) + "\n", capture_output=True,
                                  text=True, timeout=120)
        if proc.returncode:
            raise PsrtError(f"`{' '.join(args)}` failed: {proc.stderr.strip()}")

    def _shaping(self, dev: str, rate_bits: int) -> list[list[str]]:
        """The tc commands that shape ``dev``'s egress to ``rate_bits``."""
        if self.queueing == "tbf":
            return [["qdisc", "add", "dev", dev, "root", *self._tbf(rate_bits)]]
        burst = str(burst_for(rate_bits))
        rate, small = f"{rate_bits}bit", max(8000, rate_bits // 100)
        return [
            ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "3"],
            ["class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate,
             "burst", burst, "cburst", burst],
            # Bare acknowledgements: a guaranteed sliver of the link, and first call on the rest.
            ["class", "add", "dev", dev, "parent", "1:1", "classid", "1:2", "htb", "rate", f"{small}bit",
             "ceil", rate, "prio", "0", "quantum", "1514", "burst", burst, "cburst", burst],
            ["qdisc", "add", "dev", dev, "parent", "1:2", "pfifo", "limit", "100000"],
            # The data, first in first out.
            ["class", "add", "dev", dev, "parent", "1:1", "classid", "1:3", "htb", "rate", f"{rate_bits - small}bit",
             "ceil", rate, "prio", "1", "quantum", "65536", "burst", burst, "cburst", burst],
            ["qdisc", "add", "dev", dev, "parent", "1:3", "bfifo", "limit", str(QUEUE_BYTES)],
            # TCP's bare acknowledgements: no options past the 20-byte IPv4 header, under 64 bytes in all, and no
            # flag but ACK. Only those: a small data segment sent ahead of its stream's earlier ones would arrive
            # out of order, and TCP would take that for loss and send the earlier ones again.
            ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
             "match", "ip", "protocol", "6", "0xff", "match", "u8", "0x05", "0x0f", "at", "0",
             "match", "u16", "0x0000", "0xffc0", "at", "2", "match", "u8", "0x10", "0xff", "at", "33",
             "flowid", "1:2"],
        ]

    def _exec(self, host: str) -> list[str]:
        if host not in self.hosts:
            raise ConfigError(f"no host {host!r} in this cluster (hosts: {', '.join(self.hosts)})")
        # A private mount namespace per process, in which the host's own directory is /dev/shm.
        return ["ip", "netns", "exec", self.namespace(host), "unshare", "--mount", "--propagation", "private",
                "sh", "-c", 'mount --bind "$0" /dev/shm && exec "$@"', self._shm[host]]

    def spawn(self, host: str, cmd: Sequence[str], **kwargs: Any) -> Child:
        """Start ``cmd`` inside ``host``'s namespace as a :class:`~psrt.control.process.Child` (``kwargs`` go to it,
        labelled ``host`` unless given); :meth:`close` stops it if it still runs."""
        child = Child(cmd, wrap=self._exec(host), **{"label": host, **kwargs})
        self._procs.append(child.proc)
        self._children.append(child)
        return child

    def popen(self, host: str, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``cmd`` inside ``host``'s namespace as :class:`subprocess.Popen` does (``kwargs`` go to it), in a
        process group of its own that :meth:`close` stops if it still runs; :meth:`spawn` also reads its output."""
        proc = popen([*self._exec(host), *cmd], label=host, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: str, cmd: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside ``host``'s namespace to completion."""
        return subprocess.run(["ip", "netns", "exec", self.namespace(host), *cmd], capture_output=True, text=True,
                              timeout=timeout)

    def close(self) -> None:
        """Stop every process started here and remove the namespaces, links and bridge."""
        stop_processes(self._procs, grace=5.0)
        stop_children(self._children, grace=0.0)  # already stopped: this joins their readers and closes pipes
        self._procs.clear()
        self._children.clear()
        for ns in self._created_ns:
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)  # removes the veth pair with it
        self._created_ns.clear()
        if self._bridge_made:
            _ip("link", "del", self.bridge, check=False)
            self._bridge_made = False
        for directory in self._shm.values():
            shutil.rmtree(directory, ignore_errors=True)
        self._shm.clear()
        if self._took_sigterm:
            self._took_sigterm = False
            _give_sigterm_back()

    def __enter__(self) -> VirtualCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
