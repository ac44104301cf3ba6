"""Decisions taken on a running job: the start-up pipeline (probe the link, plan, choose the
sharding) and the step-end controllers (depth re-planner, automatic compression). The only
layer that lets rank 0 decide and broadcasts the decision.

Imports: `overlap.base`, `overlap.plan`, `overlap.runtime`, `overlap.observe`, `overlap.kernels`.
"""
