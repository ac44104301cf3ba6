"""Run a command inside a network namespace whose loopback is throttled (`tc tbf`): an emulated
link, on which time spent on the wire is time the CPU is free, as with a real network, unlike
gloo's loopback copies. Needs root.

    python benchmarks/netns.py --rate 2gbit -- torchrun --nproc-per-node 2 script.py
"""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from typing import Iterator, Optional, Sequence


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def throttled_namespace(rate: str) -> Iterator[list[str]]:
    """A namespace whose loopback is throttled to `rate`; yields the prefix that runs in it."""
    if os.geteuid() != 0:
        raise PermissionError("emulated links need root for `ip netns` and `tc`")
    name = f"overlap-{os.getpid()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    _ip("netns", "add", name)
    try:
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        _ip("netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", "256kb",
            "latency", "400ms")
        yield ["ip", "netns", "exec", name]
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", required=True, help="link rate for tc tbf, e.g. 2gbit or 400mbit")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="command to run (after --)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    with throttled_namespace(args.rate) as prefix:
        return subprocess.run(prefix + command).returncode


if __name__ == "__main__":
    sys.exit(main())
