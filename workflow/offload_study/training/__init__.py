"""Stage 3, train: one run, supervised, becomes one record.

``runner`` composes ``supervise`` (process group, limits, signals), ``launch`` (torchrun/srun
lines), ``outcome`` (what happened, from facts), ``metrics``, ``provenance`` and ``placement``
(temp folder, moved into place, archived). Each rank runs ``harness`` with ``probes``,
``tokens`` and ``steady`` (when measuring starts and stops); ``logparse`` reads rank logs.
"""
