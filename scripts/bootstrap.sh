#!/usr/bin/env bash
# Set up .venv/ in the repository root with the harness (editable) and its test extra.
#
#   bash scripts/bootstrap.sh        # then: .venv/bin/python -m harness run | .venv/bin/python -m pytest -q
#
# Idempotent: a second run reuses .venv/ and returns in seconds when pyproject.toml is unchanged.
# torch goes in first: the CUDA build (plain `pip install torch`) when `nvidia-smi` works, else
# torch==2.13.0 (a local CPU wheel where the machine has one; elsewhere pip's default build).
#
# Environment: PYTHON=/path/to/python3.x picks the interpreter (3.10+; default: python3, else the newest
# python3.1x on PATH); BOOTSTRAP_FORCE=1 reinstalls the package even when nothing changed.
# Output is quiet (pip -qq: its errors still show, its warnings do not); on a terminal each long step
# says every 15 s that it is still running. Any failure exits non-zero.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VENV=.venv
CPU_TORCH=${CPU_TORCH:-torch==2.13.0}
PIP_QUIET=(-qq --disable-pip-version-check --no-input --progress-bar off)
HTA=holistictraceanalysis==0.5.0
HTA_NEEDS=("plotly>=5.11" "psutil>=5.9" "networkx>=3.1" "PyYAML>=6.0")

say() { printf '[bootstrap] %s\n' "$*"; }
die() { printf '[bootstrap] error: %s\n' "$*" >&2; exit 1; }

# run "$@"; on a terminal, say every 15 s that $1 is still running and for how long (quiet otherwise)
with_heartbeat() {
  local what=$1 rc=0 hb=""
  shift
  if [[ -t 1 ]]; then
    ( s=0; while sleep 15; do s=$((s + 15)); printf '[bootstrap]   ... %s (%d s)\n' "$what" "$s"; done ) &
    hb=$!
  fi
  "$@" || rc=$?
  if [[ -n $hb ]]; then kill "$hb" 2>/dev/null; wait "$hb" 2>/dev/null || true; fi
  return $rc
}

py_ok() {  # $1 = interpreter; true when it runs and is >= 3.10
  "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null
}

pick_python() {
  if [[ -n "${PYTHON:-}" ]]; then
    py_ok "$PYTHON" || die "PYTHON=$PYTHON is not a Python 3.10+ interpreter"
    echo "$PYTHON"; return
  fi
  local c
  for c in python3 python3.13 python3.12 python3.11 python3.10; do
    if command -v "$c" >/dev/null 2>&1 && py_ok "$c"; then echo "$c"; return; fi
  done
  die "no Python 3.10+ found on PATH; install one (e.g. apt-get install python3 python3-venv) or set PYTHON=/path/to/python3"
}

t0=$SECONDS

# 1. the virtual environment
if [[ -x $VENV/bin/python ]] && py_ok $VENV/bin/python; then
  say "reusing $VENV ($($VENV/bin/python -V 2>&1))"
else
  [[ -e $VENV ]] && { say "removing a broken $VENV"; rm -rf "$VENV"; }
  PY=$(pick_python)
  say "creating $VENV with $PY ($("$PY" -V 2>&1))"
  "$PY" -m venv "$VENV" || die "'$PY -m venv' failed; install the venv module (Debian/Ubuntu: apt-get install python3-venv)"
fi
VPY=$ROOT/$VENV/bin/python
"$VPY" -m pip --version >/dev/null 2>&1 || "$VPY" -m ensurepip -q || die "pip is missing in $VENV"

# 2. torch first, so the package's `torch>=2.4` is already satisfied by the right build
if "$VPY" -c 'import torch' >/dev/null 2>&1; then
  say "torch $("$VPY" -c 'import torch; print(torch.__version__)') already installed"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  say "GPU found (nvidia-smi): installing the CUDA build of torch (a few minutes: about 2.5 GB to download)"
  with_heartbeat "installing torch" "$VPY" -m pip install "${PIP_QUIET[@]}" torch || die "pip install torch failed"
  if [[ $("$VPY" -c 'import torch; print(torch.version.cuda or "")') == "" ]]; then
    say "warning: the torch that was installed is a CPU build; the harness will run on the CPU" >&2
  fi
else
  say "no GPU (nvidia-smi absent or failing): installing $CPU_TORCH (a minute or two)"
  with_heartbeat "installing $CPU_TORCH" "$VPY" -m pip install "${PIP_QUIET[@]}" "$CPU_TORCH" \
    || die "pip install $CPU_TORCH failed"
fi

# 3. the harness itself (editable) with the test extra; skipped when nothing changed
STAMP=$VENV/.bootstrap-stamp
want=$(cksum < pyproject.toml)
if [[ "${BOOTSTRAP_FORCE:-0}" != 1 && -f $STAMP && "$(cat "$STAMP")" == "$want" ]] \
   && "$VPY" -c 'import harness, pytest, hydra, torchlens' >/dev/null 2>&1; then
  say "harness already installed (pyproject.toml unchanged)"
else
  say "installing the harness: pip install -e '.[test]' (a minute or two)"
  with_heartbeat "installing the harness and its test extra" "$VPY" -m pip install "${PIP_QUIET[@]}" -e '.[test]' \
    || die "pip install -e '.[test]' failed"
  echo "$want" > "$STAMP"
fi

# 4. Holistic Trace Analysis (the independent trace reader of tests/test_hta.py): its wheel declares
# jupyterlab (and pins pytest), which TraceAnalysis never imports, so it goes in with --no-deps after
# what it does import (plotly, psutil, networkx, PyYAML); pip may then name jupyterlab as missing
if "$VPY" -c 'import hta.trace_analysis' >/dev/null 2>&1; then
  say "holistictraceanalysis already installed"
else
  say "installing $HTA (--no-deps) and its runtime needs: ${HTA_NEEDS[*]}"
  "$VPY" -m pip install "${PIP_QUIET[@]}" "${HTA_NEEDS[@]}" || die "pip install ${HTA_NEEDS[*]} failed"
  "$VPY" -m pip install "${PIP_QUIET[@]}" --no-deps "$HTA" 2>&1 | grep -v "dependency resolver\|requires jupyterlab\|requires pydot\|requires pytest" || true
  "$VPY" -c 'import hta.trace_analysis' || die "$HTA does not import"
fi

say "checking that the harness imports (torch's first import takes a while)"
"$VPY" -c 'import harness, torch; print("[bootstrap] ok: torch", torch.__version__,
      "| CUDA available:", torch.cuda.is_available())' || die "the installed harness does not import"
say "done in $((SECONDS - t0)) s"
