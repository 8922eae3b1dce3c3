"""What building a study's model on the CPU holds at its peak, against what it holds once built:
the output head transformers makes whole and then ties to the embeddings shows as the gap.

    PYTHONPATH=workflow python benchmarks/tied_head_rss.py config/studies/holdout-h200-qwen2.yaml

The last line is the same as JSON (bytes), for tests/test_architecture.py, which runs this on a
small tied model.

Builds the model as FSDP2's runner does (``AutoModelForCausalLM.from_config``, fp32, random
init) in this process and prints the peak RSS, the RSS once built and the tied head the layout
reads (``architecture.tied_head``), GiB. Needs the model's fp32 size in free memory (the 1.5 B
Qwen2: ~7 GiB, ~25 s on 2 cores). One build: the gap is what glibc gave back, exact to a page
for a head far above its mmap threshold.
"""

from __future__ import annotations

import json
import os
import resource
import sys

from offload_study.core import architecture, units
from offload_study.core.contracts import ModelSpec
from offload_study.core.study import read_yaml


def rss_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(study_file: str) -> int:
    import transformers

    model = read_yaml(study_file)["model"]
    spec = ModelSpec("config", None, dict(model["config"]), None)
    layout = architecture.layout(spec)
    built = transformers.AutoModelForCausalLM.from_config(architecture.transformers_config(spec))
    peak, now = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss_bytes()
    gib = units.bytes_to_gib
    print(f"{study_file}: {layout.params:,} parameters, tied head {layout.tied_head:,}")
    print(f"peak RSS {gib(peak):.2f} GiB, once built {gib(now):.2f} GiB ({type(built).__name__})")
    head = gib(4 * layout.tied_head)
    print(f"gap {gib(peak - now):.3f} GiB; the tied head in fp32 {head:.3f} GiB")
    print(json.dumps({"freed_bytes": peak - now, "tied_head": layout.tied_head}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
