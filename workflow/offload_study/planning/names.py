"""The names of expanded scenarios: ``<scenario>__<knob>-<value>...`` (a sweep's combo), short
and distinct for every distinct value."""

from __future__ import annotations

from offload_study.core.yamlsafe import normalize_number

# Short names for common sweep knobs, so generated scenario names stay readable.
KNOB_ABBREV = {
    "micro_batch": "mb",
    "gradient_accumulation_steps": "gas",
    "reduce_bucket_size": "rbs",
    "stage3_prefetch_bucket_size": "pbs",
    "prefetch_bucket_size": "pbs",
    "stage3_max_live_parameters": "live",
    "stage3_param_persistence_threshold": "persist",
    "sub_group_size": "sgs",
    "offload_optimizer_ratio": "ratio",
    "bind_cores": "bind",
    "pin_memory": "pin",
    "super_offload": "super",
    "cpuadam_cores_perc": "adamcores",
}


def format_value(value) -> str:
    """5e8 -> '5e8', 1000000000 -> '1e9', 123456789 -> '1.23456789e8', 4 -> '4', True -> 'true'.

    Every digit is kept (distinct values, distinct names); a value that 6 digits wrote exactly
    keeps the name it had before.
    """
    value = normalize_number(value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and abs(value) >= 10_000:
        digits = str(abs(value))  # exact: no float in between
        mantissa = f"{digits[0]}.{digits[1:]}".rstrip("0").rstrip(".")
        return f"{'-' if value < 0 else ''}{mantissa}e{len(digits) - 1}"
    return str(value)


def expanded_name(base: str, combo: dict) -> str:
    parts = [f"{KNOB_ABBREV.get(k, k)}-{format_value(v)}" for k, v in combo.items()]
    return "__".join([base, *parts])
