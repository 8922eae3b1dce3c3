"""offload-study: DeepSpeed ZeRO-3 offload comparison studies (library used by the Snakemake rules)."""

__version__ = "0.1.0"
