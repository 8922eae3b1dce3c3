"""The prediction's measured error bands: the one reader of workflow/offload_study/data/error_bands.json.

    {"calibrated": {"step_time": p, "gpu_allocated": p, "gpu_reserved": p, "host": p},
     "uncalibrated": {same keys}, "measured_by": "<command>", "records": N}

``p`` is a relative error (0.1 = ±10 %): the worst error of the model over the committed GPU
records, with the cluster's calibration (``calibrated``) or with the GPU catalog's values
(``uncalibrated``, offload_study.prediction.catalog). ``null`` for a quantity not measured yet
(a band nobody measured is not made up). The benchmark that measures them
(``measured_by``) writes the file; the plan, the seed block and the report read it here.
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path

from offload_study.core.contracts import read_json
from offload_study.core.study import StudyError

#: package data, as the GPU catalog: the model's own measured accuracy, the same wherever the
#: workflow runs (benchmarks/prediction_accuracy.py --bands-out rewrites it in a checkout)
PATH = Path(str(resources.files("offload_study").joinpath("data/error_bands.json")))
CASES = ("calibrated", "uncalibrated")
QUANTITIES = ("step_time", "gpu_allocated", "gpu_reserved", "host")
TOP_KEYS = {*CASES, "measured_by", "records"}
#: what the benchmark adds to say how it measured (text; optional) and the CPU study's bands
DESCRIPTIVE_KEYS = {"statistic", "calibration", "cpu"}


def _band(value, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise StudyError(f"{where}: {value!r} is not a relative error (a number, 0.1 = ±10 %)")
    if value < 0:
        raise StudyError(f"{where}: {value!r} is negative (a relative error, 0.1 = ±10 %)")
    return float(value)


def validate(data, source: str) -> dict:
    """The file's content checked: every key present with its type; one error naming the key."""
    if not isinstance(data, dict):
        raise StudyError(f"{source}: not a JSON object")
    for key in sorted(TOP_KEYS - set(data)):
        raise StudyError(f"{source}: missing key {key!r}")
    for key in sorted(set(data) - TOP_KEYS - DESCRIPTIVE_KEYS):
        known = ", ".join(sorted(TOP_KEYS | DESCRIPTIVE_KEYS))
        raise StudyError(f"{source}: unknown key {key!r} (keys: {known})")
    if not isinstance(data["measured_by"], str) or not data["measured_by"].strip():
        raise StudyError(f"{source}: measured_by: the command that measured the bands")
    records = data["records"]
    if isinstance(records, bool) or not isinstance(records, int) or records < 1:
        raise StudyError(f"{source}: records: {records!r} is not a count of records (>= 1)")
    out = {"measured_by": data["measured_by"], "records": records}
    for case in CASES:
        bands = data[case]
        if not isinstance(bands, dict):
            raise StudyError(f"{source}: {case}: not an object of {', '.join(QUANTITIES)}")
        for key in QUANTITIES:
            if key not in bands:
                raise StudyError(f"{source}: {case}.{key}: missing")
        for key in set(bands) - set(QUANTITIES):
            raise StudyError(f"{source}: {case}.{key}: unknown (keys: {', '.join(QUANTITIES)})")
        out[case] = {key: _band(bands[key], f"{source}: {case}.{key}") for key in QUANTITIES}
    return out


def load(path: str | Path = PATH) -> dict:
    """error_bands.json, validated (:class:`StudyError` naming the file and key otherwise)."""
    if not Path(path).is_file():
        raise StudyError(f"{path}: no error bands (benchmarks/prediction_accuracy.py writes them)")
    try:
        data = read_json(path)
    except ValueError as err:
        raise StudyError(f"{path}: not JSON: {err}") from err
    return validate(data, str(path))


def bands(calibrated: bool, path: str | Path = PATH) -> dict[str, float | None]:
    """The bands of one case: quantity -> relative error (None: not measured)."""
    return load(path)["calibrated" if calibrated else "uncalibrated"]


def label(calibrated: bool) -> str:
    """The word every output uses for the case."""
    return "calibrated" if calibrated else "uncalibrated"


def plan_is_calibrated(prediction: dict | None) -> bool:
    """Whether a plan.json's ``prediction`` was made from a calibration (plans written before
    the catalog existed say nothing: they were calibrated when they had a calibration)."""
    prediction = prediction or {}
    if "calibrated" in prediction:
        return bool(prediction["calibrated"])
    return bool(prediction.get("calibration"))


def text(p: float | None) -> str:
    """ "±10 %" ("band not measured" for None)."""
    return "band not measured" if p is None else f"±{100 * p:.0f} %"
