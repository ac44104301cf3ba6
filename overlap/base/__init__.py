"""The floor every other package stands on: settings and the environment variables (read
here and nowhere else), the mixed-precision policy, the step record, profiler labels, unit
discovery and the rules both the runtime and the planning arithmetic apply.

Imports: `overlap.kernels` only.
"""
