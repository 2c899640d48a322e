"""``python -m harness run`` end to end, as a user runs it: a subprocess from the repository root.

One tiny run must complete and write its run directory; every kind of bad input must end with
exit code 2, exactly one ``error: ...`` line on stderr, and no run directory that looks complete.
Each subprocess pays a few seconds of imports, so all of them start with the session's background
runs (tests/conftest.py, a few at a time) and each test only inspects its own result.
"""
from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import cli_env, main_lines as _main_line

ROOT = Path(__file__).resolve().parents[1]
TINY_MODE = "workload.mode={name: t, base_size: 128, image_size: 64, crop: true}"
FAST = ["model=tiny", TINY_MODE, "workload.decode_tokens=4", "measure.repeats=1", "measure.warmup=0"]
TIMEOUT_S = 240
CUDA = torch.cuda.is_available()
ENV = cli_env()


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str
    root: Path          # the run.root of this invocation

    def run_dirs(self) -> list:
        return sorted(p for p in self.root.glob("*") if p.is_dir()) if self.root.exists() else []


def harness_run(root: Path, *overrides: str) -> Result:
    cmd = [sys.executable, "-m", "harness", "run", *overrides, f"run.root={root}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, env=ENV)
    return Result(proc.returncode, proc.stdout, proc.stderr, root)


# ------------------------------------------------------------------------------ bad input files

def _png(width: int, height: int, noise: bool = False) -> bytes:
    from PIL import Image
    import numpy as np

    buf = io.BytesIO()
    if noise:
        arr = np.random.default_rng(0).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
        Image.fromarray(arr).save(buf, "PNG")
    else:
        Image.new("RGB", (width, height), (255, 255, 255)).save(buf, "PNG")
    return buf.getvalue()


def huge_png_header(width: int = 20000, height: int = 20000) -> bytes:
    """A 1x1 PNG whose IHDR claims width x height (CRC fixed), so only the header is huge."""
    png = bytearray(_png(1, 1))
    assert png[12:16] == b"IHDR"
    png[16:24] = struct.pack(">II", width, height)
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])) & 0xFFFFFFFF)
    return bytes(png)


def corrupt_png() -> bytes:
    """A valid PNG header and IHDR with its pixel data cut short and scrambled."""
    png = bytearray(_png(64, 64, noise=True))
    body = png[:len(png) // 2]
    body[60:80] = bytes(20)
    return bytes(body)


def _missing_tensor_checkpoint(path: Path) -> Path:
    """A tiny-model model.safetensors with one tensor removed."""
    from safetensors.torch import load_file, save_file

    from conftest import load_tiny_cfg
    from harness.models.build import build_model, save_weights

    f = save_weights(build_model(load_tiny_cfg(), seed=0), path)
    sd = load_file(str(f))
    del sd["model.layers.1.self_attn.q_proj.weight"]
    save_file(sd, str(f))
    return path


def bad_cases(tmp: Path) -> dict:
    """case id -> (overrides, words: one of them must be in the error line)."""
    (tmp / "empty").mkdir()
    (tmp / "corrupt.png").write_bytes(corrupt_png())
    (tmp / "notimage.png").write_bytes(b"%PDF-1.4 this is not an image\n" * 20)
    (tmp / "huge.png").write_bytes(huge_png_header())
    (tmp / "vendor-empty").mkdir()
    nocode = tmp / "vendor-nocode"
    nocode.mkdir()
    (nocode / "config.json").write_text(json.dumps({"model_type": "deepseek_vl_v2"}))
    (nocode / "tokenizer_config.json").write_text("{}")
    ckpt = _missing_tensor_checkpoint(tmp / "ckpt-missing")
    cases = {
        "images-missing": ([f"workload.images={tmp / 'nope.png'}"], ["does not exist"]),
        "images-empty-dir": ([f"workload.images={tmp / 'empty'}"], ["no image files"]),
        "images-corrupt": ([f"workload.images={tmp / 'corrupt.png'}"], ["corrupt", "truncated", "not an image"]),
        "images-not-image": ([f"workload.images={tmp / 'notimage.png'}"], ["not an image"]),
        "images-20000x20000": ([f"workload.images={tmp / 'huge.png'}"], ["20000x20000", "max_pixels"]),
        "mode-unknown": (["workload.mode=huge"], ["unknown crop mode"]),
        "vendor-missing": (["model=vendor", f"model.path={tmp / 'no-such-model'}"], ["does not exist"]),
        "vendor-empty": (["model=vendor", f"model.path={tmp / 'vendor-empty'}"], ["empty"]),
        "vendor-no-code": (["model=vendor", f"model.path={nocode}"], ["modeling code", "modeling_deepseekocr"]),
        "weights-missing-tensor": (["model.weights=path", f"model.path={ckpt}"], ["missing"]),
    }
    if not CUDA:
        cases["device-cuda-without-gpu"] = (["device=cuda"], ["cuda", "CUDA"])
    return cases


# --------------------------------------------------------------------------- the subprocess pool

def start_runs(tmp_path_factory, submit) -> dict:
    """The good run and every bad-input run, started with the session's background runs
    (tests/conftest.py); id -> (Future[Result], words)."""
    tmp = tmp_path_factory.mktemp("cli")
    inputs = tmp / "inputs"
    inputs.mkdir()
    jobs = {"tiny-ok": (FAST + ["measure.kernels=true"], None)}
    for name, (overrides, words) in bad_cases(inputs).items():
        # model=vendor replaces model=tiny; everything else runs on the tiny model
        base = [o for o in FAST if not (o == "model=tiny" and overrides[0] == "model=vendor")]
        jobs[name] = (base + overrides, words)
    return {name: (submit(harness_run, tmp / "runs" / name, *ov), words) for name, (ov, words) in jobs.items()}


def _describe(res: Result) -> str:
    return f"rc={res.rc}\n--- stderr ---\n{res.stderr[-3000:]}\n--- stdout ---\n{res.stdout[-2000:]}"


# ---------------------------------------------------------------------------------------- tests

def test_tiny_run_completes(runs):
    res = runs["tiny-ok"][0].result()
    assert res.rc == 0, _describe(res)
    dirs = res.run_dirs()
    assert len(dirs) == 1, dirs
    run = dirs[0]
    assert not run.name.endswith("-failed") and not (run / "FAILED").exists()
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "complete", manifest.get("error")
    assert manifest["model"]["adapter"] == "reference"
    assert (run / ".hydra" / "config.yaml").is_file()
    assert (run / "routing.csv").is_file()

    stages = pd.read_csv(run / "stages.csv")
    assert {"sam", "clip", "projector", "prefill", "decode", "request"} <= set(stages["stage"])
    kernels = pd.read_csv(run / "kernels.csv")
    assert len(kernels) > 0
    assert kernels["stage"].notna().mean() >= 0.99
    assert set(stages.columns) >= {"repeat", "profiled", "call"} and stages["repeat"].dtype == "int64"
    assert stages["profiled"].dtype == bool and stages["call"].dtype == "int64"       # observations only, typed
    req = stages[(stages["stage"] == "request") & stages["profiled"]]
    assert len(req) == 1, stages[stages["stage"] == "request"]
    assert float(req["attributed_fraction"].iloc[0]) >= 0.99
    # where the run's own time went: consecutive phases that add up to the total, printed at the end
    timing = manifest["timing"]
    assert {"set-up", "model build", "calibration", "timed repeats", "profiled request", "trace export",
            "report"} <= set(timing["phases_s"])
    assert sum(timing["phases_s"].values()) == pytest.approx(timing["total_s"], abs=0.01)
    assert [ln for ln in res.stdout.splitlines() if ln.startswith("[harness] time ")]
    assert manifest["memory"]["need_bytes"]["total"] <= manifest["memory"]["free_bytes"]


BAD = ["images-missing", "images-empty-dir", "images-corrupt", "images-not-image", "images-20000x20000",
       "mode-unknown", "device-cuda-without-gpu", "vendor-missing", "vendor-empty", "vendor-no-code",
       "weights-missing-tensor"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_fails_cleanly(runs, case):
    if case not in runs:
        pytest.skip("a CUDA GPU is available, so device=cuda is not bad input here")
    fut, words = runs[case]
    res = fut.result()
    assert res.rc == 2, _describe(res)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, _describe(res)
    line = lines[0]
    assert line.startswith("error: ") and "; fix: " in line, line
    assert any(w in line for w in words), f"none of {words} in: {line}"
    assert "Traceback" not in res.stdout
    for d in res.run_dirs():   # none, or a failed one that says so
        manifest = json.loads((d / "manifest.json").read_text()) if (d / "manifest.json").exists() else {}
        assert manifest.get("status") != "complete", d
        assert d.name.endswith("-failed") and (d / "FAILED").is_file(), (d, sorted(p.name for p in d.iterdir()))


# ------------------------------------------------------- one-line errors in-process (issue 26 item 9)

def test_a_value_split_at_a_space_gets_the_quoted_override(capsys, tmp_path):
    rc, err = _main_line(capsys, ["run", "workload.images=my", "pages/", f"run.root={tmp_path}"])
    assert rc == 2 and err == ["error: 'pages/' is not an override: a space split the value of workload.images "
                               "into 'my' and 'pages/'; fix: quote it: \"workload.images='my pages/'\""]
    assert not any(tmp_path.iterdir())


def test_a_value_with_letters_outside_ascii_gets_the_quoted_override(capsys, tmp_path):
    rc, err = _main_line(capsys, ["run", "workload.images=pagés/", f"run.root={tmp_path}"])
    assert rc == 2 and err == ["error: the value of workload.images ('pagés/') has letters outside ASCII, which "
                               "Hydra's override syntax reads only in quotes; fix: quote it: "
                               "\"workload.images='pagés/'\""]
    from harness.cli import check_overrides
    assert check_overrides(["workload.images='pagés/'"]).workload.images == "pagés/"   # the fix parses


@pytest.mark.parametrize("where", ["nowhere", "empty"])
def test_harness_conf_pointing_nowhere_names_the_variable_and_the_path(capsys, tmp_path, monkeypatch, where):
    from harness import cli

    conf = tmp_path / where
    if where == "empty":
        conf.mkdir()
    monkeypatch.setenv("HARNESS_CONF", str(conf))
    monkeypatch.setattr(cli, "CONF_DIR", conf)
    rc, err = _main_line(capsys, ["run", f"run.root={tmp_path / 'runs'}"])
    problem = "is not a directory" if where == "nowhere" else "has no config.yaml"
    assert rc == 2 and err == [f"error: HARNESS_CONF={conf} {problem}; fix: point HARNESS_CONF at a Hydra config "
                               "tree holding config.yaml (a copy of src/harness/conf), or unset it"]
    assert not (tmp_path / "runs").exists()


def test_compare_into_an_existing_file_is_one_line(capsys, tmp_path):
    data = ROOT / "tests" / "data" / "runs"
    out = tmp_path / "taken"
    out.write_text("a file, not a directory\n")
    rc, err = _main_line(capsys, ["compare", str(data / "gpu_tiny_a"), str(data / "gpu_tiny_b"), "--out", str(out)])
    assert rc == 2 and err == [f"error: --out {out} already exists; fix: give --out a new directory (compare never "
                               "writes into an existing one)"]
    assert out.read_text() == "a file, not a directory\n"
