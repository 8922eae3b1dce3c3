"""Would a dispatch time that grows with a layer's parameters predict the step better, leaving
one model out?

    PYTHONPATH=workflow python benchmarks/step_width_term.py

The step model's host time per layer and micro-step is one fitted constant per engine
(``dispatch_s_per_layer``). The time per layer that each committed GPU record implies (the value
that makes its predicted step its measured one) grows with the model's width: about 0.019 s for
model H (hidden 768) and 0.04 s and more for the 7B shapes (hidden 4096). This fits, per engine
and leaving each model out as ``prediction_accuracy.py`` does, the efficiency and a time per
layer of ``a + b x (the layer's parameters, millions)``, and prints how many records come within
10 % beside the same fit with ``b = 0``. Both fits search the same coarse grids (a slice of
``accuracy.EFFICIENCIES``; ``a`` every 1 ms), so the two counts compare with each other, not with
the headline of ``prediction_accuracy.py``, whose grids are finer. About 20 s.
"""

from __future__ import annotations

import math

import prediction_accuracy as pa

from offload_study.prediction import accuracy

STEP_TARGET = 0.10
EFFICIENCIES = accuracy.EFFICIENCIES[::2]
PER_LAYER_S = tuple(round(0.008 + 0.001 * i, 4) for i in range(25))
PER_MILLION_S = (0.0, 2e-5, 4e-5, 6e-5, 8e-5, 1e-4, 1.2e-4, 1.5e-4, 2e-4)


def layer_millions(model: tuple) -> float:
    """A decoder layer's parameters, millions, from prediction_accuracy's model key (hidden,
    layers, heads, key/value heads, FFN, vocab): attention's four projections and a gated MLP."""
    hidden, _, heads, kv_heads, ffn, _ = model
    kv = kv_heads * hidden // heads
    return (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn) / 1e6


def step(row: dict, efficiency: float, a: float, b: float) -> float:
    return row["parts"].total(efficiency, a + b * row["millions"])


def fit(rows: list[dict], per_million: tuple[float, ...]) -> tuple[float, float, float]:
    """(efficiency, a, b) of least squared log error over ``rows``."""
    return min(
        ((e, a, b) for e in EFFICIENCIES for a in PER_LAYER_S for b in per_million),
        key=lambda c: sum(math.log(step(r, *c) / r["step"][1]) ** 2 for r in rows),
    )


def within(rows: list[dict], per_million: tuple[float, ...]) -> dict[tuple, list[bool]]:
    """Model -> whether each of its records is within the target, fitted without the model
    (per engine; an engine the other models lack takes every engine's records)."""
    hits: dict[tuple, list[bool]] = {}
    for model in sorted({r["model"] for r in rows}):
        others = [r for r in rows if r["model"] != model]
        for engine in sorted({r["engine"] for r in rows if r["model"] == model}):
            fitted = fit([r for r in others if r["engine"] == engine] or others, per_million)
            for r in rows:
                if r["model"] == model and r["engine"] == engine:
                    error = step(r, *fitted) / r["step"][1] - 1
                    hits.setdefault(model, []).append(abs(error) <= STEP_TARGET)
    return hits


def main() -> int:
    rows = []
    for folder, study in pa.GPU_RECORDS.items():
        rows += pa.record_rows(pa.REPO_ROOT / folder, pa.REPO_ROOT / study, pa._shipped(folder))
    rows = [r for r in rows if r["kind"] == "GPU" and r["outcome"] == "ok" and r["parts"]]
    rows = [{**r, "millions": layer_millions(r["model"])} for r in rows if r["step"][1]]
    for words, per_million in (
        ("per layer, one constant", (0.0,)),
        ("a + b x millions", PER_MILLION_S),
    ):
        hits = within(rows, per_million)
        total = sum(sum(v) for v in hits.values())
        print(f"{words}: step within {STEP_TARGET:.0%} on {total}/{len(rows)} (model left out)")
        for model, h in hits.items():
            print(
                f"  hidden {model[0]}, {model[1]} layers ({layer_millions(model):.1f} M per layer): {sum(h)}/{len(h)}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
