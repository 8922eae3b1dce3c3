"""What every stage shares, and nothing stage-specific: the typed contracts between stages
(run spec, rank stats, step rows, metrics, provenance, calibration, predictions; atomic JSON),
study and cluster validation against the schemas, the data-only YAML loader, the GPU catalog, memory units (GiB <-> bytes, bytes per parameter
of what ZeRO-3 keeps where).

Imports nothing from the stage packages.
"""
