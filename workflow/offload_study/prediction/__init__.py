"""Predict before you spend: memory and step time of a run from its spec, its DeepSpeed config
and the cluster's calibration (``predict``), the calibration itself (``calibrate``), and the
search for the fastest config under a budget (``recommend``).
"""

# the fsdp2 engine's model registers itself with predict (predict.ENGINE_MODELS)
from offload_study.prediction import fsdp2_model  # noqa: E402, F401
