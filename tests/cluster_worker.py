"""Run by torchrun on each node of the emulated cluster (benchmarks/cluster.py): trains
parity cases, each with its wrap settings, one after another in the same process group, on
this rank's slice of each global batch and, on rank 0, saves what the test compares with one
process (a list, in the order of the runs given)."""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from parity import train                      # noqa: E402
from parity_cases import CASES               # noqa: E402


def main() -> None:
    runs_json, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = []
    for case_name, wrap in json.loads(runs_json):
        case = dataclasses.replace(CASES[case_name], wrap={**CASES[case_name].wrap, **wrap})
        results.append(train(case, dist.get_rank(), dist.get_world_size(), sharded=True))
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    # Leave without tearing the process group down: on this loaded machine the destructor
    # deadlocked against gloo's threads once the work was done (a rank stayed alive, idle,
    # and its launcher with it, after the others had exited), the hang seen in these runs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
