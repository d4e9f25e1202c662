"""asyncops benchmarks: a TPU timeline model and CPU wall-time comparisons.

Run ``python -m benchmarks.run`` (modelled TPU step times from compiled HLO)
or ``python -m benchmarks.cpu_walltime`` (emulated variants on 8 CPU
devices). See ``design/benchmarks.md``.

A repo-only tool: not part of the ``asyncops`` wheel (it runs from a
checkout, next to ``examples/``), so its modules may change freely.
"""
