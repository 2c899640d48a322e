"""runs/examples/cpu-renovation-parity/variant_parity.py ``counts``: the profiled request's stage counts are
read from stages.csv of either layout (the current one marks the profiled request in its ``profiled``
column, the old one wrote ``repeat=profiled``), so a before/after comparison cannot pass on two empty
sections."""
from __future__ import annotations

import importlib.util
import json
import sys

KERNELS = "case,stage,call,step,name,module,family,op_group\nc,decode,0,0,gemv,mlp,linear,gemm\n"
ROUTING = "case,phase,layer,e0\nc,decode,1,3\n"
ROUTING_STEPS = "case,step,layer,experts,e0\nc,0,1,1,3\n"


def _script(repo_root, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    path = repo_root / "runs" / "examples" / "cpu-renovation-parity" / "variant_parity.py"
    spec = importlib.util.spec_from_file_location("variant_parity", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_dir(path, stages: str):
    path.mkdir()
    for name, text in (("stages.csv", stages), ("kernels.csv", KERNELS), ("routing.csv", ROUTING),
                       ("routing_steps.csv", ROUTING_STEPS)):
        (path / name).write_text(text)
    return path


def test_counts_reads_the_profiled_request_of_both_layouts(repo_root, monkeypatch, tmp_path):
    parity = _script(repo_root, monkeypatch)
    # current layout: timed repeat 0 (not counted) and the profiled request (repeat 1, profiled=True)
    new = _run_dir(tmp_path / "new", "case,repeat,profiled,stage,call,gpu_ms,kernels,launches_per_step\n"
                                     "c,0,False,decode,-1,2.0,,\n"
                                     "c,1,True,decode,-1,2.5,40,10.0\n")
    # old layout: the same profiled row as repeat=profiled, call=all (all calls: -1 in the new layout)
    old = _run_dir(tmp_path / "old", "case,repeat,stage,call,gpu_ms,kernels,launches_per_step\n"
                                     "c,0,decode,all,2.0,,\n"
                                     "c,profiled,decode,all,2.5,40,10.0\n")
    got = {}
    for run in (new, old):
        parity.counts(str(run), str(run / "counts.json"))
        got[run.name] = json.loads((run / "counts.json").read_text())
    assert got["new"]["stages"] == {"c/decode/-1": [40, 10.0]}
    assert got["new"]["ops"] == {"c/decode/0/0/gemv": 1}
    assert got["new"]["routing"] == [{"case": "c", "phase": "decode", "layer": 1, "e0": 3}]
    assert got["old"] == got["new"]
    assert parity.compare(str(new / "counts.json"), str(old / "counts.json")) == 0
