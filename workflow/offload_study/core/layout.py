"""Where every file of a study lives: the one owner of the results layout.

Every path is relative to the workflow's working directory (where ``snakemake`` runs, or
``--directory``), never to where this package is installed: a site environment installed from
one checkout runs the studies of another. A study run on cluster X reads and writes only under
X's folders, so it never reads, overwrites or is shadowed by cluster Y's records or report::

    config/clusters/<cluster>.yaml            cluster descriptions
    config/calibration/<cluster>.json         calibration shipped for clusters we cannot measure
    config/references/                        reference values with tolerances (check)
    results/<cluster>/calibration.json        calibration measured on the cluster
    results/<cluster>/<study>/                a study's records on one cluster   (study_dir)
        configs/<scenario>.json               DeepSpeed config
        configs/<scenario>.run.json           run spec
        plan.unchecked.json, plan.json, plan.csv
        <scenario>/rep<k>/                    one run's record                    (record_dir)
        archive/<scenario>/rep<k>/<stamp>/    superseded copies of records
        runs.csv, runs.parquet, summary.csv   collect's tables
        recommend/                            recommend's rounds and decision
        logs/                                 the rules' logs
    reports/<cluster>/<study>/report.html     the study's report on that cluster  (report_dir)
    reports/index.html, reports/site/         the published site (publish)
    reports/compare/<name>.html               bundles compared (compare)
    bundles/<study>--<cluster>.tar.gz         a study's records packed (bundle)
"""

from __future__ import annotations

import os
from pathlib import Path

CLUSTER_DIR = Path("config/clusters")
SHIPPED_CALIBRATION_DIR = Path("config/calibration")
REFERENCES_DIR = Path("config/references")
RESULTS_ROOT = "results"
REPORTS_ROOT = "reports"
BUNDLES_DIR = "bundles"
CALIBRATION_FILE = "calibration.json"
UNCALIBRATED_FILE = "calibration.uncalibrated.json"
PLAN_JSON = "plan.json"
PLAN_UNCHECKED_JSON = "plan.unchecked.json"
PLAN_CSV = "plan.csv"
CONFIGS_DIR = "configs"
ARCHIVE_DIR = "archive"
RECOMMEND_DIR = "recommend"
LOGS_DIR = "logs"
RUNS_CSV = "runs.csv"
RUNS_PARQUET = "runs.parquet"
SUMMARY_CSV = "summary.csv"
#: recommend's decision, and each round's selection (a pattern over "round"), in RECOMMEND_DIR
RECOMMENDATION_JSON = "recommendation.json"
RECOMMEND_ROUND = "selected.round{round}.json"


def cluster_file(cluster: str, cluster_dir: str | Path = CLUSTER_DIR) -> Path:
    return Path(cluster_dir) / f"{cluster}.yaml"


def cluster_results(cluster: str) -> str:
    """results/<cluster>: what was measured on one cluster (its studies, its calibration)."""
    return f"{RESULTS_ROOT}/{cluster}"


def study_dir(cluster: str, study: str) -> str:
    """results/<cluster>/<study>"""
    return f"{cluster_results(cluster)}/{study}"


def measured_calibration(cluster: str) -> str:
    return f"{cluster_results(cluster)}/{CALIBRATION_FILE}"


def catalog_calibration(cluster: str) -> str:
    """The uncalibrated stand-in of a CUDA cluster not yet calibrated (GPU catalog values:
    offload_study.prediction.catalog)."""
    return f"{cluster_results(cluster)}/{UNCALIBRATED_FILE}"


def shipped_calibration(cluster: str) -> str:
    return str(SHIPPED_CALIBRATION_DIR / f"{cluster}.json")


def planning_calibration(cluster: dict) -> str:
    """What a plan predicts from: the cluster's measured calibration, else the file
    config/calibration ships for it, else for a CUDA cluster the GPU catalog's values
    (uncalibrated: a plan works on any machine; `snakemake calibrate` measures), else (a CPU
    cluster, whose accelerator every node has) the measured file, which rule calibrate makes."""
    name = cluster["name"]
    for path in (measured_calibration(name), shipped_calibration(name)):
        if os.path.exists(path):
            return path
    if cluster["accelerator"] == "cuda":
        return catalog_calibration(name)
    return measured_calibration(name)


def ds_config_path(study: str | Path, scenario: str) -> str:
    """The DeepSpeed config of a scenario of the study folder ``study``."""
    return f"{study}/{CONFIGS_DIR}/{scenario}.json"


def run_spec_path(study: str | Path, scenario: str) -> str:
    return f"{study}/{CONFIGS_DIR}/{scenario}.run.json"


def record_dir(study: str | Path, scenario: str, repeat: int | str) -> str:
    """One run's record: <study>/<scenario>/rep<k> (a Snakemake pattern with "{rep}")."""
    return f"{study}/{scenario}/rep{repeat}"


def study_of_record(record: str | Path) -> Path:
    """results/<cluster>/<study>/<scenario>/rep<k> -> results/<cluster>/<study>"""
    return Path(record).parents[1]


def archive_dir(study: str | Path, scenario: str, repeat: int, stamp: str) -> Path:
    """<study>/archive/<scenario>/rep<k>/<stamp>: a superseded copy of a record."""
    return Path(study) / ARCHIVE_DIR / scenario / f"rep{repeat}" / stamp


def made_from_records(study: str | Path) -> list[Path]:
    """What the workflow made from a study's records, never measured: collect's tables,
    recommend's decision and its rounds after the first (round 0 reads only the plan)."""
    study = Path(study)
    recommend = study / RECOMMEND_DIR
    first = RECOMMEND_ROUND.format(round=0)
    rounds = [p for p in recommend.glob(RECOMMEND_ROUND.format(round="*")) if p.name != first]
    return [
        *(study / name for name in (RUNS_CSV, RUNS_PARQUET, SUMMARY_CSV)),
        recommend / RECOMMENDATION_JSON,
        *sorted(rounds),
    ]


def report_dir(cluster: str, study: str) -> str:
    """reports/<cluster>/<study>: a study's report as measured on one cluster."""
    return f"{REPORTS_ROOT}/{cluster}/{study}"


def report_html(cluster: str, study: str) -> str:
    return f"{report_dir(cluster, study)}/report.html"


def other_cluster_summaries(cluster: str, study: str, root: str | Path = ".") -> list[str]:
    """summary.csv of the same study collected here from other clusters (side by side)."""
    found = Path(root).glob(f"{RESULTS_ROOT}/*/{study}/{SUMMARY_CSV}")
    return sorted(str(p) for p in found if p.parent.parent.name != cluster)
