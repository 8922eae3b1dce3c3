"""Stage 2, admit: may a run go ahead?

Owns the checks that run before anything trains: the DeepSpeed ops a scenario needs
(``preflight``, built ahead by ``ops``).
"""
