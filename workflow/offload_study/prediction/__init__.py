"""Predict before you spend: memory and step time of a run from its spec, its engine's config
and the cluster's calibration (``predict``, the front door over each engine's model; what the
engines' models share: ``shared``), the calibration itself (``calibrate``), and the search for
the fastest config under a budget (``recommend``).
"""
