"""Planning arithmetic: the step replay (cost model), prefetch depth and bucket size,
sharding and compression choices, memory formulas and predictions, link models. Pure
functions of sizes and measured times, so they run and are tested without a process group.

Imports: `overlap.base` only; never `torch.distributed`.
"""
