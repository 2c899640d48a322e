"""``python -m harness VERB [hydra overrides]``: run, analyze, graph, calibrate, profile, bench, compare, summarize, merge.

Hydra verbs compose ``conf/config.yaml`` (schema: ``harness.config.HarnessConfig``) with the
overrides (``-m`` for multirun works) and get a fresh run directory with its ``.hydra/`` snapshot.
Before Hydra starts, the overrides are composed once and validated (``check_overrides``): an
unknown key, a wrong type or an out-of-range value ends here, before any run directory or model
exists. The output directory Hydra would use (``hydra.run.dir``, or ``hydra.sweep.dir`` with
``-m``) is then created by this process alone (``harness.rundir.claim``: a name that exists gets
``-2``, ``-3``, ...) and handed to Hydra, so two runs started in the same second never share
one. Each verb then gets the typed config (``to_config``: the one conversion).

A single ``run`` gets its directory prepared before Hydra writes anything (``rundir.prepare``: a
``starting`` manifest and the failed manifest in reserve), and from then on SIGTERM and SIGHUP stop
the process like SIGINT (unless inherited as ignored: ``nohup``): what ends the process before the
run takes the directory over (Hydra unable to write its own files on a full disk, a signal during
the start-up) closes it as ``failed`` / ``interrupted`` with one line (``rundir.close_unstarted``).
An override Hydra cannot parse because a space split its value, or because the value has letters
outside ASCII, is answered with the quoted override to type; a bare word after a key that takes
no text (``workload.decode_tokens=4 measure``) is named as a stray word, with the key or group it
may have meant (``stray_word``). A ``MemoryError`` (or torch's GPU out-of-memory error) outside a
run's own handling is one line and exit 2 (``harness.memory_check.out_of_memory``).

Exit codes and the one stderr line: 0 done; 2 a problem the user can fix (``error: <problem>;
fix: <fix>``); 1 an internal or write error, a full disk (``error: ...``); 130 / 143 / 129 a run
interrupted by SIGINT / SIGTERM / SIGHUP (``interrupted: ...``).
"""
from __future__ import annotations

import errno
import logging
import os
import sys
from pathlib import Path

from .conf_tree import CONF_DIR
from .errors import HarnessError, RunStopped

HYDRA_VERBS = ("run", "analyze", "graph", "calibrate", "profile", "bench")
#: verbs over run directories (argparse, no Hydra)
RUN_DIR_VERBS = ("compare", "summarize", "merge")
#: Hydra command-line flags that take a value (the value is not an override)
#: Hydra flags that print something instead of running the verb (no output directory is made)
HYDRA_INFO_FLAGS = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc")
HYDRA_VALUE_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun",
                     "--cfg", "-c", "--package", "-p", "--info", "-i")
USAGE = """usage: python -m harness VERB [overrides...]

verbs:
  run        build the model, run every case, measure stages -> runs/<time>-<name>/
  analyze    analytic FLOPs/bytes per stage (no GPU, no weights)
  graph      module tree + torchlens call graph
  calibrate  measured GEMM TFLOP/s and copy GB/s of this device
  profile    Nsight Compute / Systems over one stage's NVTX range
  bench      python -m harness bench TARGET [bench.TARGET.option=...]   (kernel and measurement benches:
             decode_step, attention, moe, sam_attention, linear, overhead, ...; harness.bench.config)
  compare    python -m harness compare RUN_A RUN_B
  summarize  python -m harness summarize runs/multirun-.../   (one table and plot for a sweep)
  merge      python -m harness merge RUN_A RUN_B [...] --out DIR   (one run and report from runs split
             across processes on one machine: same GPU, revision, settings and calibration record)

examples:
  python -m harness run
  python -m harness run +experiment=crop_mode
  python -m harness run model=vendor model.path=models/deepseek-ocr model.trust_remote_code=true workload.images=pages/
"""


def _fail(exc: HarnessError) -> None:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)


def _overrides(args: list[str]) -> list[str]:
    """The key=value overrides among Hydra's command-line arguments (flags and their values dropped)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a.startswith("-"):
            skip = a in HYDRA_VALUE_FLAGS
            continue
        out.append(a)
    return out


def syntax_error(overrides: list[str], exc: Exception) -> HarnessError:
    """The one-line error for overrides Hydra cannot parse. A value that a space split into two
    arguments, or that holds letters outside ASCII (which Hydra reads only in quotes), gets the
    quoted override to type instead; anything else ``config.config_error``'s message."""
    import typing

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from .config import config_error

    parser = OverridesParser.create()
    for i, text in enumerate(overrides):
        try:
            parser.parse_overrides([text])
        except Exception:  # noqa: BLE001 - this is the override that does not parse
            break
    else:
        return config_error(exc)
    key, eq, value = text.partition("=")
    if not eq and i > 0 and "=" in overrides[i - 1]:
        key, _, value = overrides[i - 1].partition("=")
        kind = schema_type(key)
        if kind is str or kind is None or kind is typing.Any:   # text (or a key the schema does not type)
            return HarnessError(f"{text!r} is not an override: a space split the value of {key} into "
                                f"{value!r} and {text!r}", f"quote it: \"{key}='{value} {text}'\"")
        return stray_word(text, key, kind)
    if eq and any(ord(c) > 127 for c in value):
        return HarnessError(f"the value of {key} ({value!r}) has letters outside ASCII, which Hydra's override "
                            "syntax reads only in quotes", f"quote it: \"{key}='{value}'\"")
    return config_error(exc)


def schema_type(key: str):
    """The type the config schema (``harness.config.HarnessConfig``) gives the dotted ``key``
    (Optional[X] -> X; a dataclass for a group such as ``measure``), None for a key it does not know."""
    import dataclasses
    import typing

    from .config import HarnessConfig

    tp = HarnessConfig
    for part in key.lstrip("+~").split("."):
        if not dataclasses.is_dataclass(tp):
            return None
        hints = typing.get_type_hints(tp)
        if part not in hints:
            return None
        tp = hints[part]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) is typing.Union and len(args) == 1:
            tp = args[0]
    return tp


def stray_word(word: str, key: str, kind) -> HarnessError:
    """The error for a bare ``word`` after ``key=VALUE`` where ``key`` takes no text (``kind``: its
    schema type): the word is no part of that value; the fix names what it could have meant."""
    import dataclasses

    what = getattr(kind, "__name__", None) or str(kind).replace("typing.", "")
    meant = schema_type(word)
    if meant is not None and dataclasses.is_dataclass(meant):
        keys = [f.name for f in dataclasses.fields(meant)]
        fix = f"drop {word!r}, or set one of its keys: {word}.KEY=VALUE ({', '.join(keys)})"
    elif meant is not None:
        fix = f"drop {word!r}, or give it a value: {word}=VALUE"
    else:
        fix = f"drop {word!r}"
    return HarnessError(f"{word!r} is not an override (overrides are KEY=VALUE): it follows {key}, which takes "
                        f"{'an' if what[:1].lower() in 'aeiou' else 'a'} {what}, so it is no part of that value", fix)


def _expand(overrides: list[str]) -> list[list[str]]:
    """Override lists to validate: the overrides as given, then, for each sweep (``-m k=a,b``),
    one list per swept value (other sweeps at their first value)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as exc:  # noqa: BLE001 - Hydra's parser raises its own exception types
        raise syntax_error(overrides, exc) from None
    base, sweeps = [], []
    for text, ov in zip(overrides, parsed):
        if ov.is_sweep_override():
            values = [str(v) for v in ov.sweep_string_iterator()]
            key = text.split("=", 1)[0]
            sweeps.append((len(base), key, values))
            base.append(f"{key}={values[0]}" if values else text)
        else:
            base.append(text)
    lists = [base]
    for i, key, values in sweeps:
        for v in values[1:]:
            alt = list(base)
            alt[i] = f"{key}={v}"
            lists.append(alt)
    return lists


def refuse_moved_knobs(args: list[str]) -> None:
    """An execution knob given under its old name (``model.kv_cache=static``) is refused before
    Hydra composes anything, naming ``execution.<knob>``."""
    from .config import moved_knob

    for text in _overrides(args):
        key, sep, value = text.partition("=")
        err = moved_knob(key, value if sep else None)
        if err is not None:
            raise err


#: verbs that run the model: their executions are checked on the device before Hydra starts
MODEL_VERBS = ("run", "graph", "profile")


def check_overrides(args: list[str], verb: str = "run"):
    """Compose the config with ``args``' overrides and validate it (every swept value too; for a
    verb that runs the model, every case's execution on the device: ``setup.check_cases``; for
    ``run``, the experiment's module and its check: ``lifecycle.experiment_class``); returns the
    typed config of the first composition. Raises HarnessError."""
    return _compose_checked(args, verb)[0]


def _compose_checked(args: list[str], verb: str = "run") -> tuple:
    """(``check_overrides``' config, {``hydra.run.dir``, ``hydra.sweep.dir``: as resolved for the
    first composition})."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf, open_dict

    from .config import config_error, to_config

    refuse_moved_knobs(args)
    first, dirs = None, {}
    for overrides in _expand(_overrides(args)):
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
                cfg = compose("config", overrides=overrides, return_hydra_config=first is None)
                if first is None:
                    dirs = {k: str(OmegaConf.select(cfg, k)) for k in ("hydra.run.dir", "hydra.sweep.dir")}
                    with open_dict(cfg):
                        del cfg["hydra"]
        except HarnessError:
            raise
        except Exception as exc:  # noqa: BLE001 - Hydra/OmegaConf composition errors
            raise config_error(exc) from None
        hc = to_config(cfg)
        kind = None
        if verb == "run":         # the experiment's module is there and takes this config
            from .lifecycle import experiment_class
            kind = experiment_class(hc, None if not _multirun(args) else "gpus" if "hydra/launcher=gpus" in args
                                    else "other")
        if kind is not None:
            kind.check_overrides(hc, overrides)
        if verb in MODEL_VERBS:
            from .setup import check_cases
            check_cases(hc, execution_of=kind.execution_of if kind is not None else None)
        first = first or hc
    GlobalHydra.instance().clear()
    if verb == "bench":
        from .bench.verb import check_bench
        check_bench(first)
    if first.run.only is not None and verb not in MODEL_VERBS:   # check_cases prepared run.only's cases
        from .setup import check_run_only
        check_run_only(first)
    return first, dirs


def _multirun(args: list[str]) -> bool:
    return "-m" in args or "--multirun" in args


def claim_output_dir(args: list[str], dirs: dict) -> tuple:
    """(``args`` with the directory Hydra writes into (``hydra.run.dir``, or ``hydra.sweep.dir``
    under ``-m``; ``dirs`` as ``_compose_checked`` resolved them) replaced by one this process
    created (``harness.rundir.claim``), that directory). Unchanged args and None when a flag only
    prints (``--cfg``, ``--help``)."""
    from .rundir import claim

    if any(a.split("=", 1)[0] in HYDRA_INFO_FLAGS for a in args):
        return list(args), None
    key = "hydra.sweep.dir" if _multirun(args) else "hydra.run.dir"
    try:
        path = claim(Path(dirs[key]))
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise                        # a full disk: exit 1 (``_main``)
        raise HarnessError(f"cannot create the run directory {dirs[key]} ({exc.strerror or exc})",
                           "point run.root at a folder you can write to") from None
    kept = [a for a in args if a.split("=", 1)[0].lstrip("+~") != key]
    return kept + [f"{key}='" + str(path).replace("'", "\\'") + "'"], path   # quoted: spaces and the like survive


def _task(verb: str):
    def task(cfg) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        from .config import to_config

        logging.getLogger("harness").setLevel(logging.INFO)
        out = Path(HydraConfig.get().runtime.output_dir)
        multirun = HydraConfig.get().mode == RunMode.MULTIRUN
        from .sweep import job_started
        job_started()                     # this job's own start-up begins here (a multirun's later jobs)
        try:
            from .sweep import pin_gpu_for_job
            pin_gpu_for_job(out)          # a sweep job's own GPU, before anything touches CUDA
            hc = to_config(cfg)
            if verb == "run":          # every experiment alike: its module (experiment_module) plugs into it
                from .lifecycle import run_experiment
                run_experiment(hc, out)
            elif verb == "analyze":
                from .analytic import analyze_from_config
                analyze_from_config(hc, out)
            elif verb == "graph":
                from .callgraph import graph_from_config
                graph_from_config(hc, out)
            elif verb == "calibrate":
                from .roofline.calibrate import calibrate_from_config
                calibrate_from_config(hc, out)
            elif verb == "profile":
                from .external import profile_from_config
                profile_from_config(hc, out)
            elif verb == "bench":
                from .bench.verb import bench_from_config
                bench_from_config(hc, out)
        except RunStopped as exc:   # the run directory is closed; its one line and exit code
            print(exc.line, file=sys.stderr)
            sys.exit(exc.exit_code)
        except HarnessError as exc:
            if multirun:      # fail this job only: Hydra marks it failed and the sweep's other jobs go on
                print(f"error: {exc}", file=sys.stderr)
                raise
            _fail_unstarted(verb, out, exc)
        except ImportError as exc:
            _fail_unstarted(verb, out, HarnessError(f"verb {verb!r} is not available in this build ({exc})",
                                                    "update the harness"))
        except OSError as exc:    # outside a run's own handling (the other verbs' outputs, caches)
            if multirun:
                raise
            sys.exit(_write_failed(exc, "check that the path named is a directory you can write to"))
        except Exception as exc:  # noqa: BLE001 - out of memory is one line (the run verb closes its own run)
            from .memory_check import out_of_memory
            err = out_of_memory(exc, f"the {verb} verb")
            if err is exc:
                raise
            if multirun:
                print(f"error: {err}", file=sys.stderr)
                raise err from exc
            _fail_unstarted(verb, out, err)
    return task


def check_conf_dir() -> None:
    """Refuse a config tree that is not there (``HARNESS_CONF`` names the variable and the path)."""
    where = (f"HARNESS_CONF={os.environ['HARNESS_CONF']}" if os.environ.get("HARNESS_CONF")
             else f"the packaged config tree {CONF_DIR}")
    fix = ("point HARNESS_CONF at a Hydra config tree holding config.yaml (a copy of src/harness/conf), or unset it"
           if os.environ.get("HARNESS_CONF") else "reinstall the harness")
    if not CONF_DIR.is_dir():
        raise HarnessError(f"{where} is not a directory", fix)
    if not (CONF_DIR / "config.yaml").is_file():
        raise HarnessError(f"{where} has no config.yaml", fix)


def _write_failed(exc: OSError, fix: str) -> int:
    """One line for a write that failed outside a run directory: exit 1 for a full disk, else 2."""
    from .stopping import write_fix

    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(exc, (FileExistsError, NotADirectoryError)) and exc.filename:
        what = f"cannot write into {exc.filename}: a file is in the way of a directory"
    else:
        what = f"cannot write {exc.filename}" if exc.filename else "a write failed"
    print(f"error: {what} ({exc.strerror or exc}); fix: {write_fix(exc) if full else fix}", file=sys.stderr)
    return 1 if full else 2


def _fail_unstarted(verb: str, out: Path, exc: HarnessError) -> None:
    """``_fail``; a run refused before it took its directory over marks that directory failed first."""
    if verb == "run":
        from .rundir import close_unstarted
        close_unstarted(out, "failed", str(exc))
    _fail(exc)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:   # Ctrl-C before any run directory exists (imports, composing the config)
        print("interrupted: SIGINT", file=sys.stderr)
        return 130


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    verb, rest = argv[0], argv[1:]
    if verb in RUN_DIR_VERBS:
        if verb == "compare":
            from .report.compare import compare_main as verb_main
        elif verb == "summarize":
            from .report.summarize import summarize_main as verb_main
        else:
            from .report.merge import merge_main as verb_main
        try:
            return verb_main(rest)
        except HarnessError as exc:
            _fail(exc)
        except OSError as exc:   # --out names a file, a folder it cannot write, a full disk
            return _write_failed(exc, "give --out a new directory you can write to" if verb != "summarize" else
                                 "give --out a directory you can write to (a new one, or an existing directory; "
                                 "not a file)")
    if verb not in HYDRA_VERBS:
        print(f"error: unknown verb {verb!r}; fix: use one of {', '.join(HYDRA_VERBS + RUN_DIR_VERBS)}",
              file=sys.stderr)
        return 2
    logging.raiseExceptions = False   # a log record a full disk cannot take is dropped, not printed with a traceback
    from .stopping import write_fix

    try:
        check_conf_dir()
        if verb == "bench":
            from .bench.config import bench_args
            rest = bench_args(rest)
        first, dirs = _compose_checked(rest, verb)
        if verb in MODEL_VERBS and first.model.name == "vendor":   # code not allowed, no tokenizer: no run directory
            from .models.vendor.loops import refuse_code_early
            refuse_code_early(first.model.path, first.model.trust_remote_code, first.model.vendor_entry)
        rest, claimed = claim_output_dir(rest, dirs)
        prepared = claimed if (verb == "run" and claimed is not None and not _multirun(rest)) else None
        if prepared is not None:
            from .rundir import prepare
            try:
                prepare(prepared, [f"harness-{verb}"] + rest)
            except OSError:
                import shutil
                shutil.rmtree(prepared, ignore_errors=True)   # nothing of this run was written: leave no directory
                raise
    except HarnessError as exc:
        _fail(exc)
    except MemoryError as exc:   # the checks before the run (a folder of pages too large to load)
        from .memory_check import out_of_memory
        _fail(out_of_memory(exc, "the checks before the run"))
    except OSError as exc:   # a full disk before anything of the run was written
        print(f"error: cannot create the run directory ({exc.strerror or exc} writing {exc.filename}); fix: "
              f"{write_fix(exc)}", file=sys.stderr)
        return 1
    sys.argv = [f"harness-{verb}"] + rest
    return _hydra_main(verb, prepared)


def _hydra_main(verb: str, prepared) -> int:
    """Run the verb under Hydra. For a single run (``prepared``: the directory ``rundir.prepare``
    made), what stops it before the run takes that directory over (Hydra failing to write its own
    files, a signal while the harness starts) closes the directory (``rundir.close_unstarted``) and
    prints one line; Hydra's own errors reach this function instead of its printed traceback."""
    import hydra

    from . import faults
    from .interrupts import catch_signals, interrupted_by

    saved = os.environ.get("HYDRA_FULL_ERROR")
    if prepared is not None:
        os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        with catch_signals():   # SIGTERM / SIGHUP raise like SIGINT from here on (the run installs its own)
            faults.reached("start")
            hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")(_task(verb))()
        return 0
    except SystemExit:
        raise
    except BaseException as exc:
        if prepared is None and interrupted_by(exc) is None:
            raise
        return _stopped_early(prepared, exc)
    finally:
        if prepared is not None:
            os.environ.pop("HYDRA_FULL_ERROR", None) if saved is None else os.environ.update(HYDRA_FULL_ERROR=saved)


def _stopped_early(prepared, exc: BaseException) -> int:
    """Close ``prepared`` (None: no directory) after ``exc`` stopped the harness outside a run's own
    handling; prints the one line and returns the exit code."""
    import traceback

    from .interrupts import interrupted_by
    from .rundir import close_unstarted
    from .stopping import failure_text, stop_line

    signal = interrupted_by(exc)
    if prepared is None:
        print(f"interrupted: {signal.name}", file=sys.stderr)
        return signal.exit_code
    when = "while the harness was starting (no case started)"
    if signal is not None:
        status, code, error = "interrupted", signal.exit_code, f"interrupted by {signal.name} {when}"
    else:
        status, code, error = "failed", 1, failure_text(exc, when)
    trace = {} if signal else {"traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))}
    path, problem = close_unstarted(prepared, status, error, partial_hydra=isinstance(exc, OSError), **trace)
    print(stop_line(status, exc, error, 0, path, [f"manifest.json not updated ({problem})"] if problem else [],
                    signal is not None), file=sys.stderr)
    return code
