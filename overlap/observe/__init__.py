"""Readers of what the runtime recorded: the overlap report, the trace timeline and the live
memory measurement.

Imports: `overlap.base`, `overlap.plan`, `overlap.runtime`.
"""
