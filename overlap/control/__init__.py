"""Decisions taken on a running job: the start-up pipeline (`startup`: resolve settings, agree
across ranks, choose the sharding, probe the link, plan, build units, attach controllers) and
the step-end controllers (`step_end`: depth re-planner, automatic compression). The only
layer that lets rank 0 decide for the others, always through `agreement.decided_by_rank0`.

Imports: `overlap.base`, `overlap.plan`, `overlap.runtime`, `overlap.observe`, `overlap.kernels`.
"""
