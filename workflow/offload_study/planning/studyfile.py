"""Which study one Snakemake invocation means, read so that no study file can run code.

Snakemake reads a ``--configfile`` with its YAML template engine (YTE): a file with
``__use_yte__: true`` has its ``?...`` expressions evaluated as Python while the command line is
parsed, before the Snakefile runs - a plain dry run included (snakemake 9.27
``common/configfile.py``: ``yte.process_yaml(f, require_use_yte=True)``; YTE drops the key).
Nothing in a workflow can stop that, so:

- ``--config study_file=<path>`` is the way to give a study: the Snakefile reads the file with
  :mod:`offload_study.core.yamlsafe` (data only). Snakemake passes ``--config`` to every job it
  submits (SLURM too), so each job reads the same file the same way.
- ``--configfile`` is for trusted files only: Snakemake has evaluated it before the Snakefile
  runs, and no public interface of Snakemake gives a workflow the paths to read it again
  (README.md and docs/internals.md, "Security", say so).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from offload_study.core import yamlsafe
from offload_study.core.study import StudyError, read_yaml

#: the --config key that names the study file
STUDY_FILE_KEY = "study_file"
DEFAULT_STUDY = "config/config.yaml"


def merged(base: Mapping, over: Mapping) -> dict:
    """``base`` with ``over``'s keys put over it, nested mappings key by key (as Snakemake merges
    ``--config`` into a config file)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            value = merged(out[key], value)
        out[key] = value
    return out


def refuse_templates(path: str | Path, data: Mapping) -> None:
    """StudyError when ``data`` asks for Snakemake's YAML template engine."""
    if yamlsafe.TEMPLATE_KEY in data:
        raise StudyError(
            f"{path}: {yamlsafe.TEMPLATE_KEY}: Snakemake's YAML template engine runs a file's "
            "Python; study files are data only. Give studies with --config study_file=<path> "
            "(read as data, without the template engine)"
        )


def study_config(config: Mapping, default: str = DEFAULT_STUDY) -> tuple[dict, str]:
    """(the study as one config mapping, where it came from) for Snakemake's ``config``.

    ``config`` is what ``--configfile``/``--config`` gave. With ``study_file`` the study is that
    file, the other ``--config`` keys over it; else a ``--configfile`` with a ``study:`` key is
    the study (replacing the default, never merged with it); else the default study, with
    whatever was given over it (e.g. ``--config repeats=3``).
    """
    overrides = {k: v for k, v in config.items() if k != STUDY_FILE_KEY}
    path = config.get(STUDY_FILE_KEY)
    if path is None:
        if "study" in config:
            return dict(config), f"the study {config['study']!r} given with --configfile"
        return merged(read_yaml(default), overrides), default
    if not isinstance(path, str) or not path:
        raise StudyError(f"--config {STUDY_FILE_KEY}: {path!r} is not a file path")
    if "study" in overrides:
        raise StudyError(
            f"--config {STUDY_FILE_KEY}={path} and a `study:` key from --configfile or --config: "
            "give the study one way"
        )
    study = read_yaml(path)
    refuse_templates(path, study)
    return merged(study, overrides), path
