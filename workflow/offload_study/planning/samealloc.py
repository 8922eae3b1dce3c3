"""Same-allocation pair runs (study key ``same_allocation_baseline``): which run gets one, and
the short run spec it makes.

Under SLURM every run gets its own allocation, often on another node, and one GPU kind differs
10-35 % between nodes: an offload run's ratio to a baseline measured elsewhere carries that
drift. With the option on, the plan gives each run that offloads something the run spec of a
short fixed-mode run of its no-offload pair (:func:`offload_study.core.contracts.no_offload_pairs`,
the rule collect pairs scenarios by); the runner makes it in the same job, on the same cores
and GPUs, right after the run, into ``<record>/pair/``; collect takes the run's paired ratio
against it, repeat by repeat.

After, not before: the run is what the study is about, so it starts on a node nothing else
has touched in this job, and a pair that does not fit (an uncapped no-offload run) cannot leave
anything behind that slows it or kills it.
"""

from __future__ import annotations

import dataclasses

from offload_study.core.contracts import RunSpec, no_offload_pairs, offloads_nothing


def attach_pairs(study: dict, runs: list[RunSpec]) -> list[RunSpec]:
    """``runs`` with ``same_allocation_pair`` set on each one that offloads something and has a
    trained no-offload pair, when the study enables the option (else ``runs`` unchanged)."""
    option = study["same_allocation_baseline"]
    if not option["enabled"]:
        return runs
    trained = [run for run in runs if not run.predict_only]
    rows = [run.to_dict() for run in trained]
    out = []
    for run in runs:
        pair = None
        if not run.predict_only and not offloads_nothing(run.offload_optimizer, run.offload_param):
            pair = next(iter(no_offload_pairs(run.to_dict(), rows)), None)
        if pair is not None:
            short = short_run(trained[rows.index(pair)], option)
            run = dataclasses.replace(run, same_allocation_pair=short.to_dict())
        out.append(run)
    return out


def short_run(pair: RunSpec, option: dict) -> RunSpec:
    """The pair's spec as a short fixed-mode run (the option's warm-up, steps and timeout); never
    strict: its failure is data in its record, not a failed job."""
    return dataclasses.replace(
        pair,
        measure=dataclasses.replace(pair.measure, mode="fixed"),
        warmup_steps=option["warmup_steps"],
        steps=option["steps"],
        timeout_s=option["timeout_min"] * 60,
        strict=False,
        ds_config=None,
        same_allocation_pair=None,
    )
