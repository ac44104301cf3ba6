"""An emulated two-node cluster on one machine: two network namespaces (nodes), each with its own
unthrottled loopback, joined by a veth pair throttled with `tc tbf` (the inter-node link); each
node runs its own torchrun, meeting through c10d rendezvous on node 0's veth address. gloo uses
the veth (GLOO_SOCKET_IFNAME); between ranks of one node the kernel delivers locally. With
`cpus` each node's launcher runs under `taskset` on its own CPUs (`node_cpus`). Needs root.

    python benchmarks/cluster.py --rate 1gbit --nproc-per-node 2 -- script.py args...
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from common import add_options, arg_parser

NODES = 2
# Addresses exist only inside the namespaces made here, and go with them.
SUBNET = "10.213.77"
RDZV_PORT = 29431


def why_no_cluster() -> Optional[str]:
    """Why the emulated cluster cannot be built on this machine, or None."""
    if os.geteuid() != 0:
        return "needs root for ip netns and tc"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs the ip and tc commands (iproute2)"
    probe = f"ovlprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, text=True)


@dataclass
class Cluster:
    namespaces: list[str]
    addresses: list[str]
    interfaces: list[str]

    def prefix(self, node: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[node]]

    def torchrun(self, node: int, nproc_per_node: int, script_and_args: Sequence[str],
                 run_id: Optional[str] = None, nnodes: str = str(NODES),
                 max_restarts: int = 0, rdzv_conf: Sequence[str] = (), cpus: Optional[str] = None) -> list[str]:
        """The command that starts node `node`'s ranks: `nnodes` "MIN:MAX" makes the job elastic,
        `rdzv_conf` adds "key=value" settings, `cpus` (a taskset list) confines the node."""
        conf = ",".join([f"is_host={'true' if node == 0 else 'false'}", *rdzv_conf])
        pinned = ["taskset", "-c", cpus] if cpus is not None else []
        return [*self.prefix(node), *pinned, "env", f"GLOO_SOCKET_IFNAME={self.interfaces[node]}",
                sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
                f"--max-restarts={max_restarts}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.addresses[0]}:{RDZV_PORT}", f"--rdzv-id={run_id or 'overlap'}",
                f"--local-addr={self.addresses[node]}", f"--rdzv-conf={conf}", *script_and_args]


def node_cpus(node: int) -> Optional[str]:
    """Node `node`'s share of the CPUs this process may use, as a taskset list (None: no share)."""
    available = sorted(os.sched_getaffinity(0))
    share = len(available) // NODES
    if share == 0 or shutil.which("taskset") is None:
        return None
    return ",".join(str(cpu) for cpu in available[node * share:(node + 1) * share])


@contextlib.contextmanager
def two_node_cluster(rate: Optional[str]) -> Iterator[Cluster]:
    """The two namespaces and the veth pair (throttled to `rate`, None: not), deleted on exit."""
    if os.geteuid() != 0:
        raise PermissionError("the emulated cluster needs root for `ip netns` and `tc`")
    tag = uuid.uuid4().hex[:6]
    namespaces = [f"ovl{tag}n{i}" for i in range(NODES)]
    interfaces = [f"ovl{tag}v{i}" for i in range(NODES)]
    addresses = [f"{SUBNET}.{i + 1}" for i in range(NODES)]
    try:
        for ns in namespaces:
            _run("ip", "netns", "add", ns)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        _run("ip", "link", "add", interfaces[0], "type", "veth", "peer", "name", interfaces[1])
        for ns, dev, address in zip(namespaces, interfaces, addresses):
            _run("ip", "link", "set", dev, "netns", ns)
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", dev)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
            if rate is not None:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", "256kb", "latency", "400ms")
        yield Cluster(namespaces, addresses, interfaces)
    finally:
        for ns in namespaces:                      # deleting a namespace deletes its veth end
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run_on_cluster(rate: Optional[str], nproc_per_node: int, script_and_args: Sequence[str], timeout_s: float,
                   env: Optional[dict] = None) -> list[subprocess.CompletedProcess]:
    """Run a torchrun job across the two nodes; each node's completed process (killed at the deadline)."""
    with two_node_cluster(rate) as cluster:
        run_id = uuid.uuid4().hex
        procs = [subprocess.Popen(cluster.torchrun(node, nproc_per_node, script_and_args, run_id=run_id),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, **(env or {})}, start_new_session=True)
                 for node in range(NODES)]
        results = []
        try:
            for proc in procs:
                out, _ = proc.communicate(timeout=timeout_s)
                results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, None))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
                    proc.communicate()
        return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--rate", default=None, help="inter-node rate for tc tbf, e.g. 1gbit (default: unthrottled)")
    add_options(parser, nproc_per_node=2, timeout=1800.0)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="script and its arguments (after --)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no script given")
    results = run_on_cluster(args.rate, args.nproc_per_node, command, args.timeout)
    for node, result in enumerate(results):
        print(f"--- node {node} (exit {result.returncode}) ---\n{result.stdout}")
    return max(result.returncode for result in results)


if __name__ == "__main__":
    sys.exit(main())
