"""Decisions taken on a running job: the start-up pipeline (`startup`: resolve settings, agree
across ranks, choose the sharding, probe the link, plan, build units, attach controllers) and
the step-end controllers (`step_end`: depth re-planner, automatic compression). Its decisions
for every rank are rank 0's, always through `agreement.decided_by_rank0`; the runtime and the
main job take rank 0's values in a few places of their own (ARCHITECTURE.md, "Where rank 0
decides").

Imports: `overlap.base`, `overlap.plan`, `overlap.runtime`, `overlap.observe`, `overlap.kernels`.
"""
