"""The typed config tree: composition through the schema, one-line refusals of invalid values
(in process and from the command line, before any model is built), and the YAML files holding
only what differs from the schema."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.cli import check_overrides
from harness.config import HarnessConfig, ModelConfig, WorkloadConfig, from_dict
from harness.errors import HarnessError

ROOT = Path(__file__).resolve().parents[1]

BAD = {   # override -> words the one-line error must contain
    "workload.batch=two": ["workload.batch", "Integer"],
    "workload.batch=0": ["workload.batch=0", "minimum 1"],
    "measure.repeats=abc": ["measure.repeats", "Integer"],
    "measure.repeats=0": ["measure.repeats=0", "minimum 1"],
    "workload.decode_tokens=-1": ["workload.decode_tokens=-1", "minimum 0"],
    "+workload.foo=1": ["workload.foo", "unknown config key"],
    "workload.foo=1": ["workload.foo", "unknown config key"],
    "dtype=fp8": ["dtype='fp8'", "auto, bf16, fp16, fp32"],
    "model=nope": ["model/nope", "reference, tiny, vendor"],
    "device=gpu": ["device='gpu'"],
    "model.attn_implementation=fast": ["attn_implementation", "sdpa_flash"],
    "cases=[{mode: base, batch: two}]": ["cases[].batch", "Integer"],
    "model.kv_cache=static": ["model.kv_cache moved to execution.kv_cache", "fix: use execution.kv_cache=static"],
    "+model.compile=true": ["model.compile moved to execution.compile", "fix: use execution.compile=true"],
    "cases=[{mode: base, execution: {kv_cache: stack}}]": ["cases[0].execution.kv_cache='stack'", "growing, static"],
}


@pytest.mark.parametrize("override", list(BAD))
def test_invalid_values_are_refused_in_one_line(override):
    with pytest.raises(HarnessError) as exc:
        check_overrides([override])
    msg = str(exc.value)
    assert "\n" not in msg and "; fix: " in msg, msg
    assert all(w in msg for w in BAD[override]), msg


def test_a_bad_swept_value_is_refused_too():
    with pytest.raises(HarnessError, match="workload.batch"):
        check_overrides(["-m", "workload.batch=1,two"])
    assert check_overrides(["-m", "workload.batch=1,2"]).workload.batch == 1


def test_execution_is_its_own_section():
    """``execution.*`` holds how the model runs; ``model`` no longer carries the knobs; a case's
    ``execution`` overrides the run's."""
    cfg = check_overrides(["execution.kv_cache=static", "+experiment=optimize", "run.only=[vendor-style,static-grouped]"])
    assert cfg.execution.kv_cache == "static" and not hasattr(cfg.model, "kv_cache")
    from harness.setup import prepare_cases
    cases, _ = prepare_cases(cfg)                      # run.only selects among the prepared cases
    assert [c.name for c in cases] == ["vendor-style", "static-grouped"]
    first, second = (c.execution for c in cases)
    assert (first.kv_cache, first.moe_impl) == ("static", "vendor_loop")      # the run's execution
    assert (second.kv_cache, second.moe_impl) == ("static", "grouped")        # the case's own knob on top


def test_vendor_model_refuses_execution_knobs_once_naming_them():
    with pytest.raises(HarnessError) as exc:
        check_overrides(["model=vendor", "execution.linear_impl=fused"])
    assert str(exc.value) == ("execution.linear_impl=fused applies to the reference model only; the vendor code runs "
                              "as shipped; fix: drop execution.linear_impl with model=vendor, or use model=reference")
    with pytest.raises(HarnessError, match=r"^cases\[1\]\.execution\.kv_cache=static applies"):
        check_overrides(["model=vendor", "+experiment=optimize"])
    assert check_overrides(["model=vendor"]).execution == check_overrides([]).execution


@pytest.mark.parametrize("override, line", [
    ("model.kv_cache=static", "error: model.kv_cache moved to execution.kv_cache; fix: use execution.kv_cache=static"),
    # an unknown named execution: the names that exist (conf/execution/)
    ("execution=fastest",
     "error: no config option 'execution/fastest'; fix: use one of best, best-fused, vendor-style"),
])
def test_the_cli_main_refuses_in_one_line(capsys, override, line):
    from harness.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["run", override])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert exc.value.code == 2
    assert err == [line]


def test_run_only_selects_cases_by_name_and_refuses_unknown_names():
    from harness.setup import prepare_cases
    cfg = check_overrides(["+experiment=optimize", "run.only=[best-b32,vendor-style]"])
    cases, _ = prepare_cases(cfg)
    assert [c.name for c in cases] == ["vendor-style", "best-b32"]   # the experiment's order
    assert cases[1].workload.batch == 32
    with pytest.raises(HarnessError, match="no case named best-b7.*best-b8"):
        check_overrides(["+experiment=optimize", "run.only=[best-b7]"])
    with pytest.raises(HarnessError, match="selects no case"):
        check_overrides(["+experiment=optimize", "run.only=[]"])


def test_run_only_takes_the_names_the_run_prints_for_unnamed_cases():
    """crop_mode's cases have no `name`: the run names them after mode and tile grid."""
    from harness.setup import prepare_cases
    cfg = check_overrides(["+experiment=crop_mode", "run.only=[gundam-2x3,tiny]"])
    assert [c.name for c in prepare_cases(cfg)[0]] == ["tiny", "gundam-2x3"]
    with pytest.raises(HarnessError) as exc:
        check_overrides(["+experiment=crop_mode", "run.only=[gundam]"])
    assert str(exc.value) == ("run.only=['gundam']: no case named gundam; fix: name cases as the run prints them: "
                              "tiny, small, base, large, gundam-2x3")


def test_defaults_and_experiments_compose_typed():
    cfg = check_overrides([])
    assert isinstance(cfg, HarnessConfig) and isinstance(cfg.model, ModelConfig)
    assert cfg == dataclasses.replace(HarnessConfig(), run=dataclasses.replace(HarnessConfig().run, name="default"))
    crop = check_overrides(["+experiment=crop_mode"])
    assert [c.mode for c in crop.cases] == ["tiny", "small", "base", "large", "gundam"]
    assert crop.measure.repeats == 3 and crop.run.name == "crop_mode"
    tiny = check_overrides(["model=tiny", "workload.mode={name: t, base_size: 128, image_size: 64, crop: true}"])
    assert tiny.model.llm.hidden_size == 64 and tiny.workload.mode["base_size"] == 128


def _leaves(d: dict, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


@pytest.mark.parametrize("group,cls", [("model", ModelConfig), ("workload", WorkloadConfig)])
def test_yaml_files_hold_only_what_differs_from_the_schema(group, cls):
    default = dict(_leaves(dataclasses.asdict(cls())))
    for f in sorted((ROOT / "conf" / group).glob("*.yaml")):
        for key, value in _leaves(yaml.safe_load(f.read_text()) or {}):
            assert key in default, f"{f.name}: {key} is not in {cls.__name__}"
            assert value != default[key], f"{f.name}: {key}={value!r} repeats the schema default"


def test_manifest_configs_of_older_runs_load_without_unknown_keys():
    with pytest.raises(HarnessError, match="unknown config key"):
        from_dict(ModelConfig, {"name": "reference", "retired_knob": 1})
    assert from_dict(ModelConfig, {"name": "vendor", "retired_knob": 1}, strict=False).name == "vendor"


def test_command_line_refusal_exits_2_before_any_model_is_built(tmp_path):
    """As a user sees it: exit 2, exactly one `error:` line, no traceback, no run directory, and
    nothing printed by a run that started (no device line, no model built)."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    for override in ("workload.batch=two", "measure.repeats=0", "+workload.foo=1"):
        proc = subprocess.run([sys.executable, "-m", "harness", "run", override, f"run.root={tmp_path}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, env=env)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        assert "Traceback" not in proc.stderr + proc.stdout
        assert "[harness]" not in proc.stdout                      # the run verb never started
        assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------------------ named executions

#: every knob at its default: the vendor's execution (by hand)
VENDOR_STYLE = {"kv_cache": "growing", "moe_impl": "vendor_loop", "moe_kernel": "auto", "cuda_graphs": "none",
                "compile": False, "static_cache_len": None, "vision_impl": "vendor", "prefill_graphs": False,
                "linear_impl": "vendor", "vision_compile": False, "decode_attention": "sdpa", "decode_step": "modules",
                "pdl": False, "step_clock": False, "preprocess": "host", "sam_attention": "sdpa", "prefill_logits": "all",
                "prefill_compile": False}
#: optimize.yaml's best and best-fused rows as written before the executions became a config group (by hand),
#: with sam_attention=triton since it was measured faster (runs/examples/h200-sam-triton) and prefill_logits=last
#: and prefill_compile=true since both were measured faster at a batch of 128 pages (runs/examples/h200-prefill)
ROWS = {"best": {"kv_cache": "static", "moe_impl": "grouped", "cuda_graphs": "decode", "compile": True,
                 "prefill_graphs": True, "linear_impl": "fused", "decode_attention": "triton", "vision_impl": "fused",
                 "vision_compile": True, "sam_attention": "triton", "prefill_logits": "last",
                 "prefill_compile": True}}
ROWS["best-fused"] = {**ROWS["best"], "compile": False, "decode_step": "fused", "pdl": True}
BEST, BEST_FUSED = ({**VENDOR_STYLE, **ROWS[n]} for n in ("best", "best-fused"))


@pytest.mark.parametrize("name, knobs", [("best", BEST), ("best-fused", BEST_FUSED), ("vendor-style", VENDOR_STYLE)])
def test_a_named_execution_composes_to_its_knobs_and_names_itself(name, knobs):
    from harness.config import to_dict

    cfg = check_overrides([f"execution={name}"], verb="analyze")
    assert cfg.execution.execution() == knobs
    assert to_dict(cfg)["execution_name"] == name          # the manifest's config records the name


def test_knob_overrides_go_on_top_of_a_named_execution_and_no_name_stays_vendor_style():
    from harness.config import to_dict

    cfg = check_overrides(["execution=best", "execution.pdl=false", "execution.moe_kernel=torch"], verb="analyze")
    assert cfg.execution.execution() == {**BEST, "moe_kernel": "torch"} and cfg.execution_name == "best"
    fused = check_overrides(["execution=best-fused", "execution.pdl=false"], verb="analyze")
    assert fused.execution.execution() == {**BEST_FUSED, "pdl": False}
    plain = check_overrides(["execution.kv_cache=static"], verb="analyze")
    assert plain.execution.execution() == {**VENDOR_STYLE, "kv_cache": "static"}
    assert to_dict(plain)["execution_name"] is None and check_overrides([]).execution.execution() == VENDOR_STYLE


def test_named_execution_files_hold_only_their_name_and_the_knobs_they_change():
    """Each file: its own name, and knobs off the schema default or off what it extends (its defaults)."""
    files = {f.stem: yaml.safe_load(f.read_text()) for f in (ROOT / "conf" / "execution").glob("*.yaml")}
    assert sorted(files) == ["best", "best-fused", "vendor-style"]
    for name, data in files.items():
        assert data["execution_name"] == name and set(data) <= {"execution_name", "execution", "defaults"}, name
        base = dict(VENDOR_STYLE)
        for parent in data.get("defaults", []):
            if parent != "_self_":
                base.update(files[parent.split("@")[0]].get("execution") or {})
        for knob, value in (data.get("execution") or {}).items():
            assert value != base[knob], f"{name}.yaml: {knob}={value!r} is what it would be without it"


#: optimize.yaml's cases before the named executions, composed: each case's own execution knobs
LADDER = {"vendor-style": {}, "static": {"kv_cache": "static"},
          "static-grouped": {"kv_cache": "static", "moe_impl": "grouped"},
          "graphs": {"kv_cache": "static", "moe_impl": "grouped", "cuda_graphs": "decode"},
          "compiled": {"kv_cache": "static", "moe_impl": "grouped", "cuda_graphs": "decode", "compile": True},
          **dict.fromkeys(["best", "best-balanced", "best-b8", "best-b8-balanced", "best-b32", "best-b32-balanced",
                           "best-b64", "best-b64-balanced"], "best"),
          "best-fused": "best-fused", "gundam-vendor-style": {}, "gundam-best": "best"}


def test_the_optimize_ladder_names_the_executions_and_runs_what_it_ran_before():
    from harness.config import case_execution

    cfg = check_overrides(["+experiment=optimize"], verb="analyze")
    own = {c.name: {k: v for k, v in dataclasses.asdict(c.execution).items() if v is not None} if c.execution else {}
           for c in cfg.cases}
    # the one row added since: best-fused with the in-kernel clock, right after best-fused
    assert own.pop("best-fused-clock") == {**ROWS["best-fused"], "step_clock": True}
    assert [c.name for c in cfg.cases].index("best-fused-clock") == list(LADDER).index("best-fused") + 1
    cfg = dataclasses.replace(cfg, cases=[c for c in cfg.cases if c.name != "best-fused-clock"])
    assert own == {name: ROWS[row] if isinstance(row, str) else row for name, row in LADDER.items()}
    assert list(own) == list(LADDER)
    assert {c.name: c.execution_name for c in cfg.cases if c.execution_name} == {
        name: row for name, row in LADDER.items() if isinstance(row, str)}
    ran = {c.name: case_execution(cfg.execution, c).execution() for c in cfg.cases}
    assert ran["best-b64-balanced"] == ran["gundam-best"] == BEST and ran["best-fused"] == BEST_FUSED
    assert [(c.batch, c.routing, c.mode) for c in cfg.cases if c.name.startswith("best-b32")] == [
        (32, None, None), (32, "balanced", None)]
    # as before: a knob the named execution leaves unset comes from execution.*
    top = check_overrides(["+experiment=optimize", "execution.moe_kernel=torch"], verb="analyze")
    assert {case_execution(top.execution, c).moe_kernel for c in top.cases} == {"torch"}


def test_a_case_naming_an_execution_its_experiment_does_not_load_is_refused_in_one_line():
    with pytest.raises(HarnessError) as exc:
        check_overrides(["+experiment=optimize", "cases=[{name: x, execution_name: best-fuse}]"], verb="analyze")
    assert str(exc.value) == (
        "cases[0].execution_name='best-fuse' names no execution this config loads (best, best-fused); fix: name one "
        "of them, or load conf/execution/best-fuse.yaml in the experiment's defaults (- "
        "/execution@executions.best-fuse: best-fuse)")
    case = check_overrides(["+experiment=optimize", "cases=[{name: x, execution_name: best, "
                            "execution: {compile: false}}]"], verb="analyze").cases[0]
    assert (case.execution.compile, case.execution.kv_cache, case.execution.pdl) == (False, "static", None)
