"""The runtime of one step: flat groups and units, the scheduler that gathers, frees and
reduces them, the collectives on their streams, compressed collectives, hpZ node copies, the
order check, timing, process groups and materialisation of meta-device models.

Imports: `overlap.base` and `overlap.kernels`; never planning, observation, control or
checkpoint code.
"""
