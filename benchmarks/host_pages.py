"""What FSDP2's gradient copies to the host cost when they land in fresh pages.

    PYTHONPATH=workflow python benchmarks/host_pages.py --spec <run.json> [--out FILE.json]

With ``CPUOffloadPolicy`` and gradient accumulation, every micro-step after the first copies
each parameter's gradient shard down into a new pageable tensor, blocking, then adds it to the
one on the host (torch's ``foreach_reduce``). glibc maps an allocation of 32 MiB or more from the
OS afresh each time: its pages are faulted in by the copy. The step model prices that
(``engines/fsdp2/paths.py``, ``OffloadPolicyPath.pcie_seconds``) with calibrate's page-fault
rate; this measures it on the machine at hand:

1. calibrate's probes: the page-fault rate, and (with a GPU) the pinned and pageable copies;
2. with a GPU, one ``.to("cpu")`` of a device tensor per size around the threshold, as FSDP2
   does, and the same copy into touched memory;
3. with a GPU, one accumulation micro-step's host work for the spec's model, every parameter's
   fp32 gradient copied down and added as ``foreach_reduce`` does, timed, beside what the step
   model prices it at with the rates of 1 (the rest from the cluster's shipped calibration).

Without a GPU only 1's page-fault rate is measured. One JSON object goes to --out and stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from offload_study.core import contracts, layout
from offload_study.engines.fsdp2.paths import path_of
from offload_study.prediction import calibrate, shared

SIZES_MIB = (8, 16, 30, 34, 64, 256, 1024)
REPEATS = 5


def timed(op, sync, repeats: int = REPEATS) -> float:
    """Median seconds of ``op`` over ``repeats`` calls after two warm-ups (the second settles
    glibc's dynamic mmap threshold for the sizes under its maximum)."""
    op(), op()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        op()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def copies_by_size(torch) -> list[dict]:
    """Per size: GB/s of a device-to-host copy into a new tensor and into a touched one."""
    rows = []
    for mib in SIZES_MIB:
        nbytes = mib * 2**20
        src = torch.ones(nbytes // 4, device="cuda")
        touched = torch.empty(nbytes // 4)
        touched.fill_(1)
        fresh_s = timed(lambda s=src: s.to("cpu"), torch.cuda.synchronize)
        again_s = timed(lambda s=src, t=touched: t.copy_(s), torch.cuda.synchronize)
        rows.append(
            {
                "mib": mib,
                "fresh_gb_s": round(nbytes / fresh_s / 1e9, 2),
                "touched_gb_s": round(nbytes / again_s / 1e9, 2),
            }
        )
        del src, touched
    return rows


def accumulation_step(torch, tensors: tuple[int, ...]) -> float:
    """Seconds of one micro-step's host work: each gradient copied down and added."""
    grads = [torch.ones(n, device="cuda") for n in tensors]
    held = [torch.zeros(n) for n in tensors]

    def step():
        for g, h in zip(grads, held, strict=True):
            h += g.to("cpu")

    return timed(step, torch.cuda.synchronize, repeats=3)


def predicted_s(spec, shape, rates: dict) -> dict:
    """What the step model prices one such micro-step at (``OffloadPolicyPath.pcie_seconds``),
    with the cluster's shipped calibration and the rates measured here, and the fresh bytes."""
    shipped = contracts.read_calibration(layout.shipped_calibration(spec.cluster))
    cal = dataclasses.replace(shipped, **rates)
    micro_steps = spec.gradient_accumulation_steps - 1
    seconds = path_of(spec).pcie_seconds(spec, shape, cal) / micro_steps if micro_steps else 0.0
    fresh = shared.fresh_host_bytes(
        shared.DTYPE_BYTES["fp32"] * -(-t // spec.world_size) for t in shape.tensors
    )
    return {"micro_step_s": seconds, "fresh_bytes": fresh}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", type=Path, required=True, help="a run spec (configs/*.run.json)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    import torch

    spec = contracts.read_run_spec(a.spec)
    shape = shared.model_shape(spec)
    cuda = torch.cuda.is_available()
    spread = calibrate.page_fault_gb_s("cuda" if cuda else "cpu")
    if cuda:
        spread.update(calibrate.copy_gb_s(256 * 2**20))
    rates = {key: value["median"] for key, value in spread.items()}
    out = {"spec": str(a.spec), "params": shape.params, "rates": rates, "spread": spread}
    if cuda:
        out["copies_by_size"] = copies_by_size(torch)
        out["accumulation_step_s"] = accumulation_step(torch, shape.tensors)
        out["predicted"] = predicted_s(spec, shape, rates)
    text = json.dumps(out, indent=1)
    if a.out:
        a.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
