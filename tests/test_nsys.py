"""Nsight Systems without nsys: locating nsys and its importer in fake install trees, the profile
command, stats parsing and the stage comparison on hand-made fixtures (tests/data/nsys/README.md),
and the whole ``profile tool=nsys`` session against a fake nsys that leaves a .qdstrm behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from harness.errors import HarnessError
from harness.external import nsys as N
from harness.external import nsys_session as S
from harness.schema.stages import read_observations

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "nsys"
TINY = ["model=tiny", "workload.mode={name: t, base_size: 128, image_size: 64, crop: true}"]


def _exe(path: Path, text: str = "#!/bin/sh\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


# ------------------------------------------------------------------------------------- locating

def test_find_nsys_prefers_nsight_systems_then_newest_version(tmp_path):
    empty = str(tmp_path / "nowhere")
    ncu_nsys = _exe(tmp_path / "opt/nvidia/nsight-compute/2025.1.0/host/target-linux-x64/nsys")
    assert N.find_nsys(tmp_path, path_env=empty) == ncu_nsys
    _exe(tmp_path / "opt/nvidia/nsight-systems/2024.9.1/bin/nsys")
    newest = _exe(tmp_path / "opt/nvidia/nsight-systems/2024.10.1/bin/nsys")
    assert N.find_nsys(tmp_path, path_env=empty) == newest
    on_path = _exe(tmp_path / "bin/nsys")
    assert N.find_nsys(tmp_path, path_env=str(tmp_path / "bin")) == on_path
    assert N.find_nsys(tmp_path / "none", path_env=empty) is None


def test_find_importer_in_nsight_compute_and_nsight_systems_layouts(tmp_path):
    ncu = tmp_path / "opt/nvidia/nsight-compute/2025.1.0/host"
    nsys = _exe(ncu / "target-linux-x64/nsys")
    imp = _exe(ncu / "linux-desktop-glibc_2_11_3-x64/QdstrmImporter")
    assert N.find_importer(nsys, path_env=str(tmp_path / "nowhere")) == imp
    sys_root = tmp_path / "opt/nvidia/nsight-systems/2024.5.1"
    nsys2 = _exe(sys_root / "target-linux-x64/nsys")
    imp2 = _exe(sys_root / "host-linux-x64/QdstrmImporter")
    assert N.find_importer(nsys2, path_env=str(tmp_path / "nowhere")) == imp2


def test_importer_libraries_from_env_or_default_folder(tmp_path):
    lib = tmp_path / "deps/root/usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (lib / "libdw.so.1").write_text("")
    (lib / "libelf.so.1").write_text("")
    dirs, src = N.nsys_libs({N.LIBS_ENV: str(tmp_path / "deps/root")})
    assert dirs == [lib] and src == f"${N.LIBS_ENV}"
    with pytest.raises(HarnessError, match="holds no libdw"):
        N.nsys_libs({N.LIBS_ENV: str(tmp_path / "empty")})
    (tmp_path / "work/.nsysdeps").mkdir(parents=True)
    (tmp_path / "work/.nsysdeps/root").symlink_to(tmp_path / "deps/root")
    dirs, src = N.nsys_libs({}, cwd=tmp_path / "work")
    assert [d.name for d in dirs] == ["x86_64-linux-gnu"] and src == ".nsysdeps/root"
    env = N.with_libs({"LD_LIBRARY_PATH": "/old"}, dirs)
    assert env["LD_LIBRARY_PATH"].endswith(":/old") and "x86_64-linux-gnu" in env["LD_LIBRARY_PATH"]


def test_parse_ldd_missing():
    text = ("\tlinux-vdso.so.1 (0x00007ffd)\n\tlibdw.so.1 => not found\n"
            "\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n\tlibelf.so.1 => not found\n")
    assert N.parse_ldd_missing(text) == ["libdw.so.1", "libelf.so.1"]


# ------------------------------------------------------------------------------------- commands

def test_nsys_command_small_capture_of_the_request_range():
    cmd = N.nsys_command("request", ["python", "-m", "harness", "run"], Path("out/report"))
    assert cmd[:4] == ["nsys", "profile", "-t", "cuda,nvtx"]
    for opt in ("--sample=none", "--cpuctxsw=none", "--backtrace=none", "--capture-range=nvtx",
                "--nvtx-capture=request@harness", "--capture-range-end=stop", "--force-overwrite=true"):
        assert opt in cmd
    assert not any(c.startswith("--cuda-graph-trace") for c in cmd)
    assert cmd[cmd.index("-o") + 1] == "out/report" and cmd[-4:] == ["python", "-m", "harness", "run"]
    graph = N.nsys_command("decode", ["x"], Path("r"), cuda_graph_trace="node")
    assert "--cuda-graph-trace=node" in graph and "--nvtx-capture=decode@harness" in graph
    with pytest.raises(HarnessError):
        N.nsys_command("decode", ["x"], Path("r"), cuda_graph_trace="nodes")


def test_options_unknown_to_an_older_nsys_are_dropped_by_name():
    help_text = "  -s, --sample=\n  --cpuctxsw=\n  -t, --trace=\n"
    keep, drop = N.supported_options(help_text)
    assert keep == ["--sample=none", "--cpuctxsw=none"] and drop == ["--backtrace=none"]
    assert N.supported_options(None) == (list(N.PROFILE_OPTIONS), [])


def test_stats_and_import_commands_and_report_pick(tmp_path):
    stats = N.stats_command(Path("r.nsys-rep"), Path("o/stats"))
    assert stats[2:4] == ["--report", "nvtx_gpu_proj_sum,cuda_gpu_kern_sum"]
    assert N.import_command(Path("/x/QdstrmImporter"), Path("r.qdstrm")) == ["/x/QdstrmImporter", "-i", "r.qdstrm"]
    assert N.pick_report(tmp_path, "report", "nsys-rep") is None
    for name in ("report.nsys-rep", "report.2.nsys-rep", "report.10.nsys-rep", "other.nsys-rep"):
        (tmp_path / name).write_text("")
    assert N.pick_report(tmp_path, "report", "nsys-rep").name == "report.10.nsys-rep"


def _cfg(data: dict):
    from harness.config import HarnessConfig, from_dict, validate

    return validate(from_dict(HarnessConfig, data))


def test_settings_from_config():
    assert S.NsysSettings.from_config(_cfg({})) == S.NsysSettings("request", 1, None)
    graphs = S.NsysSettings.from_config(_cfg({"execution": {"cuda_graphs": "decode", "kv_cache": "static",
                                                        "moe_impl": "grouped"}}))
    assert graphs.cuda_graph_trace == "node"
    assert S.NsysSettings.from_config(_cfg({"execution": {"cuda_graphs": "none"}})).cuda_graph_trace is None
    assert S.NsysSettings.from_config(_cfg({"profile": {"cuda_graph_trace": "graph"}})).cuda_graph_trace == "graph"
    with pytest.raises(HarnessError, match="nsys_range"):
        S.NsysSettings.from_config(_cfg({"profile": {"nsys_range": "all"}}))


def test_portable_commands_hold_no_local_paths(tmp_path):
    child = [sys.executable, "-m", "harness", "run", "model=tiny", "measure.warmup=1", f"run.root={tmp_path}/child"]
    cmds = S.portable_commands("decode", ["tool=nsys", "stage=decode", "model=tiny", f"run.root={tmp_path}"], child,
                               S.NsysSettings())
    text = "\n".join(cmds.values())
    assert cmds["harness"] == "python -m harness profile tool=nsys stage=decode model=tiny"
    assert str(tmp_path) not in text and sys.executable not in text
    assert "python -m harness run model=tiny measure.warmup=1" in cmds["nsys"]


# -------------------------------------------------------------------------------------- parsing

def test_projected_time_per_stage_from_nvtx_gpu_proj_sum():
    proj = N.parse_stats_csv((DATA / "stats_nvtx_gpu_proj_sum.csv").read_text())
    got = N.projected_by_stage(proj)
    # not decode_step, not the default domain's range
    assert set(got) == {"request", "sam", "clip", "projector", "prefill", "decode"}
    assert got["decode"]["range"] == "harness:decode" and got["decode"]["proj_ns"] == 68244100
    assert got["sam"]["instances"] == 1 and got["sam"]["proj_ns"] == 34987654       # the StartEnd row is ignored
    bare = proj.assign(Range=proj["Range"].str.replace("harness:", "", regex=False))
    assert N.projected_by_stage(bare)["prefill"]["proj_ns"] == 72301220           # no domain shown: still found
    with pytest.raises(HarnessError, match="Total Proj Time"):
        N.projected_by_stage(pd.DataFrame({"Range": ["harness:sam"]}))


def test_compare_with_the_child_runs_cuda_event_times():
    proj = N.projected_by_stage(N.parse_stats_csv((DATA / "stats_nvtx_gpu_proj_sum.csv").read_text()))
    harness = N.harness_stage_ms(read_observations(DATA / "stages.csv"))
    assert harness["decode"] == (68.90, "cuda_event")
    cmp = N.compare_stages(proj, harness).set_index("stage")
    assert list(cmp.index) == ["sam", "clip", "projector", "prefill", "decode", "request"]
    assert cmp.loc["decode", "nsys_proj_ms"] == pytest.approx(68.2441)
    assert cmp.loc["decode", "ratio"] == pytest.approx(68.2441 / 68.90)
    assert cmp.loc["sam", "within_2pct"] is True and cmp.loc["projector", "within_2pct"] is False
    only_decode = N.compare_stages({"decode": proj["decode"]}, harness, captured=("decode",)).set_index("stage")
    assert only_decode.loc["sam", "note"] == "outside the capture range"
    host = N.compare_stages(proj, {"sam": (30.0, "host")}).set_index("stage")
    assert host.loc["sam", "within_2pct"] is None and "host clock" in host.loc["sam", "note"]
    kern = N.parse_stats_csv((DATA / "stats_cuda_gpu_kern_sum.csv").read_text())
    md = N.render(N.compare_stages(proj, harness), kern, {"capture": "request", "report": "report.nsys-rep"})
    assert "| decode | 68.244 | 68.900 | cuda_event | 0.9905 | yes |" in md and "nvjet_tst" in md


# ------------------------------------------------------------------------------ session errors

def _session_args(tmp_path):
    child = [sys.executable, "-m", "harness", "run", "model=tiny", f"run.root={tmp_path}/child"]
    return _cfg({}), "decode", child, tmp_path, ["tool=nsys", "stage=decode", "model=tiny"]


def test_missing_nsys_says_why_and_prints_a_portable_command(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "find_nsys", lambda: None)
    with pytest.raises(HarnessError) as err:
        S.run_nsys(*_session_args(tmp_path))
    msg = str(err.value)
    assert "nsys) was not found" in msg and "python -m harness profile tool=nsys stage=decode model=tiny" in msg
    assert str(tmp_path) not in msg and sys.executable not in msg
    assert "nsys profile -t cuda,nvtx" in (tmp_path / "nsys/command.txt").read_text()


def test_importer_without_libdw_fails_before_profiling(tmp_path, monkeypatch):
    nsys = _exe(tmp_path / "fake/bin/nsys")
    monkeypatch.setattr(S, "find_nsys", lambda: nsys)
    monkeypatch.setattr(S, "find_importer", lambda _: tmp_path / "fake/host-linux-x64/QdstrmImporter")
    monkeypatch.setattr(S, "missing_libs", lambda *_: ["libdw.so.1"])
    monkeypatch.delenv(N.LIBS_ENV, raising=False)
    with pytest.raises(HarnessError, match="cannot load libdw.so.1.*fetch_nsys_libs.sh"):
        S.run_nsys(*_session_args(tmp_path))
    assert not (tmp_path / "nsys/nsys.log").exists()          # nothing was profiled


# ------------------------------------------------------------------- the session, fake nsys

FAKE_NSYS = '''#!{python}
"""A stand-in for nsys: runs the profiled command, leaves a .qdstrm (as when the importer fails)."""
import shutil, subprocess, sys
from pathlib import Path
args = sys.argv[1:]
if args == ["--version"]:
    print("NVIDIA Nsight Systems version 2024.5.1.113-245134619542v0")
elif args[:2] == ["profile", "--help"]:
    print("  -t, --trace=\\n  -s, --sample=\\n  --cpuctxsw=\\n  --capture-range=\\n")   # no --backtrace
elif args[0] == "profile":
    out = Path(args[args.index("-o") + 1])
    child = args[args.index("-o") + 2:]
    Path(str(out) + ".args").write_text("\\n".join(args))
    rc = subprocess.call(child)
    Path(str(out) + ".qdstrm").write_text("raw")
    sys.exit(rc)
elif args[0] == "stats":
    base = args[args.index("--output") + 1]
    for name in ("nvtx_gpu_proj_sum", "cuda_gpu_kern_sum"):
        shutil.copy("{data}/stats_" + name + ".csv", base + "_" + name + ".csv")
'''
FAKE_IMPORTER = '''#!{python}
import sys
from pathlib import Path
q = Path(sys.argv[sys.argv.index("-i") + 1])
q.with_suffix(".nsys-rep").write_text("converted")
'''


def _profile(tmp: Path, env: dict) -> tuple:
    """(``tmp``, the finished process) of ``python -m harness profile tool=nsys`` run from ``tmp``."""
    return tmp, subprocess.run([sys.executable, "-m", "harness", "profile", "tool=nsys", "stage=decode", *TINY,
                                "workload.decode_tokens=3", f"run.root={tmp / 'runs'}"], cwd=tmp, env=env,
                               capture_output=True, text=True, timeout=240)


def start_runs(tmp_path_factory, submit) -> dict:
    """The profile session against a fake nsys (and its importer) on PATH, started with the session's
    background runs (tests/conftest.py); id -> Future[(its directory, process)]."""
    tmp = tmp_path_factory.mktemp("nsys")
    fake = tmp / "nsight"
    _exe(fake / "bin/nsys", FAKE_NSYS.format(python=sys.executable, data=DATA))
    _exe(fake / "host-linux-x64/QdstrmImporter", FAKE_IMPORTER.format(python=sys.executable))
    env = {**os.environ, "PATH": f"{fake / 'bin'}:{os.environ['PATH']}",
           "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    env.pop(N.LIBS_ENV, None)
    return {"fake-nsys": submit(_profile, tmp, env)}


def test_profile_tool_nsys_end_to_end_with_a_fake_nsys(runs):
    """The verb as a user runs it: nsys found on PATH, a .qdstrm left over and converted by the
    importer beside nsys, stats parsed, compared with the child run's own stage times."""
    tmp, proc = runs["fake-nsys"].result()
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = next((tmp / "runs").glob("*/nsys"))
    for name in ("report.nsys-rep", "nvtx_gpu_proj_sum.csv", "cuda_gpu_kern_sum.csv", "compare.csv", "report.md",
                 "command.txt", "session.json", "import.log"):
        assert (out / name).is_file(), name
    assert not (out / "report.qdstrm").exists()                  # converted, then removed
    args = (out / "report.args").read_text().split("\n")
    assert "--nvtx-capture=request@harness" in args and "--sample=none" in args and "--cpuctxsw=none" in args
    assert "--backtrace=none" not in args                        # this fake nsys does not know it
    assert "measure.warmup=1" in args and "measure.repeats=1" in args
    session = json.loads((out / "session.json").read_text())
    assert session["options_dropped"] == ["--backtrace=none"] and session["import"]["exit"] == 0
    cmp = pd.read_csv(out / "compare.csv")
    assert list(cmp["stage"]) == ["sam", "clip", "projector", "prefill", "decode", "request"]
    assert set(cmp["timer"]) == {"host"} and cmp["within_2pct"].isna().all()   # CPU: host clocks, not compared
    command = (out / "command.txt").read_text()
    assert str(tmp) not in command and sys.executable not in command
    assert "converted from a left-over .qdstrm by QdstrmImporter" in (out / "report.md").read_text()


@pytest.mark.gpu
def test_profile_tool_nsys_on_a_gpu(tmp_path):
    """With a real nsys: the report, both CSVs and a comparison row per stage."""
    if N.find_nsys() is None:
        pytest.skip("nsys not installed")
    proc = subprocess.run([sys.executable, "-m", "harness", "profile", "tool=nsys", "stage=decode", *TINY,
                           "workload.decode_tokens=4", f"run.root={tmp_path}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = next(tmp_path.glob("*/nsys"))
    cmp = pd.read_csv(out / "compare.csv").set_index("stage")
    assert (out / "report.nsys-rep").is_file() and cmp.loc["decode", "nsys_proj_ms"] > 0
