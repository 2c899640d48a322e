"""``python -m harness VERB [hydra overrides]``: run, analyze, graph, calibrate, profile, compare.

Hydra verbs compose ``conf/config.yaml`` with the overrides (``-m`` for multirun works) and get
a fresh run directory with its ``.hydra/`` snapshot. Problems a user can fix print one line,
``error: <problem>; fix: <fix>``, and exit with status 2.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from .errors import HarnessError

# The Hydra tree ships inside the package (src/harness/conf; `conf/` at the repo root links to it),
# so wheels and editable installs find it alike; HARNESS_CONF points elsewhere.
CONF_DIR = Path(os.environ.get("HARNESS_CONF", Path(__file__).resolve().parent / "conf"))
HYDRA_VERBS = ("run", "analyze", "graph", "calibrate", "profile")
USAGE = """usage: python -m harness VERB [overrides...]

verbs:
  run        build the model, run every case, measure stages -> runs/<time>-<name>/
  analyze    analytic FLOPs/bytes per stage (no GPU, no weights)
  graph      module tree + torchlens call graph
  calibrate  measured GEMM TFLOP/s and copy GB/s of this device
  profile    Nsight Compute / Systems over one stage's NVTX range
  compare    python -m harness compare RUN_A RUN_B

examples:
  python -m harness run
  python -m harness run +experiment=crop_mode
  python -m harness run model=vendor model.path=models/deepseek-ocr workload.images=pages/
"""


def _fail(exc: HarnessError) -> None:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)


def _task(verb: str):
    def task(cfg) -> None:
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf

        logging.getLogger("harness").setLevel(logging.INFO)
        out = Path(HydraConfig.get().runtime.output_dir)
        plain = OmegaConf.to_container(cfg, resolve=True)
        try:
            if verb == "run":
                from .run import run
                run(plain, out)
            elif verb == "analyze":
                from .analytic import analyze_from_config
                analyze_from_config(plain, out)
            elif verb == "graph":
                from .callgraph import graph_from_config
                graph_from_config(plain, out)
            elif verb == "calibrate":
                from .roofline.calibrate import calibrate_from_config
                calibrate_from_config(plain, out)
            elif verb == "profile":
                from .external import profile_from_config
                profile_from_config(plain, out)
        except HarnessError as exc:
            _fail(exc)
        except ImportError as exc:
            _fail(HarnessError(f"verb {verb!r} is not available in this build ({exc})",
                               "update the harness"))
    return task


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    verb, rest = argv[0], argv[1:]
    if verb == "compare":
        from .report.compare import compare_main
        try:
            return compare_main(rest)
        except HarnessError as exc:
            _fail(exc)
    if verb not in HYDRA_VERBS:
        print(f"error: unknown verb {verb!r}; fix: use one of run, analyze, graph, calibrate, profile, compare",
              file=sys.stderr)
        return 2
    import hydra

    sys.argv = [f"harness-{verb}"] + rest
    hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")(_task(verb))()
    return 0
