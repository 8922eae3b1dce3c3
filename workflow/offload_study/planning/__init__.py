"""Stage 1, plan: a study file becomes run specs and engine configs.

Owns choosing the study (``studyfile``), a recommend study's candidate scenarios
(``candidates``), expanding scenarios x sweeps into runs (``plan``, pure; names: ``names``),
DeepSpeed's offload modes (``modes``; each engine writes its own config: offload_study.engines), model presets,
same-allocation pairs, and each run's scheduler resources (``resources``).
"""
