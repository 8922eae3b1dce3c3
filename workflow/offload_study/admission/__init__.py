"""Stage 2, admit: may a run go ahead?

Owns the one judgement (``admit``: every problem of the expanded study, each with its key,
asked when the workflow is parsed, in rule plan and by the runner at launch), the study's
checks (``study_checks``) and the DeepSpeed ops a scenario needs (``preflight``, built ahead by
``ops``).
"""
