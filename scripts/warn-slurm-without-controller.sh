#!/usr/bin/env bash
# Warns (stderr, exit status 0) when a slurm.conf exists but no SLURM controller answers: the
# SLURM executor plugin runs `scontrol show config` whenever snakemake starts, and there that
# waits ~9 s, so every snakemake command (even `-n`) does. Called by scripts/setup.sh and by
# benchmarks/dryrun_overhead.py.
conf=${SLURM_CONF:-/etc/slurm/slurm.conf}
[[ -e $conf ]] && command -v scontrol >/dev/null || exit 0
timeout 20 scontrol ping 2>/dev/null | grep -q UP && exit 0
echo "WARNING: $conf exists but no SLURM controller answers (scontrol ping): every snakemake" \
  "command will wait ~9 s for the SLURM executor plugin. Start slurmctld, or move $conf" \
  "away on a machine that does not use SLURM." >&2
