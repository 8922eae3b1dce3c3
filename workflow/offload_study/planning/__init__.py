"""Stage 1, plan: a study file becomes run specs and DeepSpeed configs.

Owns choosing the study (``studyfile``), a recommend study's candidate scenarios
(``candidates``), expanding scenarios x sweeps into runs (``plan``, pure; names: ``names``),
the DeepSpeed config of a run (``dsconfig``) and its offload modes (``modes``), model presets,
same-allocation pairs, and each run's scheduler resources (``resources``).
"""
