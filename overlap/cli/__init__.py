"""The `overlap` command: `overlap train | estimate | simulate ...`.

Each subcommand lives in its own module with a `main(argv) -> int`.
"""
from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

COMMANDS = {
    "train": ("overlap.train.job", "train a small GPT with ShardedModule and report the overlap"),
    "estimate": ("overlap.cli.estimate", "per-rank memory of a model under DP / ZeRO-1/2/3"),
    "simulate": ("overlap.cli.simulate", "predicted step timeline of a model on a cluster"),
}


def _usage() -> str:
    lines = ["usage: overlap {" + ",".join(COMMANDS) + "} ...", ""]
    lines += [f"  {name:<10}{help_text}" for name, (_, help_text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] not in COMMANDS:
        print(f"overlap: unknown command {args[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[args[0]][0])
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
