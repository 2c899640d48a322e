#!/usr/bin/env bash
# Download every wheel the harness needs for another machine, so an air-gapped GPU node installs
# it with no network:
#
#   scripts/wheelhouse.sh [--dry-run] [--packages "SPEC ..."] PYVER PLATFORM OUTDIR
#   # on the node (Python PYVER, platform PLATFORM), in a clone of this repository:
#   pip install --no-index --find-links OUTDIR -e '.[test]'
#   # or the package alone (the Hydra config lives in the clone's conf/: set HARNESS_CONF=DIR):
#   pip install --no-index --find-links OUTDIR dsocr-harness
#
# PYVER     target Python: 3.10, 3.11, 3.12 or 3.13 (also 312)
# PLATFORM  a wheel platform tag, e.g. manylinux_2_28_x86_64, manylinux_2_17_aarch64; the shorthands
#           x86_64 / aarch64 mean manylinux_2_28 of that architecture. Older manylinux tags of the
#           same architecture are accepted too (glibc is backward compatible).
# OUTDIR    where the wheels go (created; existing wheels are kept and reused)
#
# What it fetches: the harness itself (built here as a pure-Python wheel), torch (PyPI's default
# build for that platform: the CUDA build on Linux x86_64, with its nvidia-* wheels; several GB)
# and every dependency of the package and its extras (EXTRAS, default "test"; e.g. EXTRAS=test,vendor),
# plus setuptools and wheel for the editable install. Binary wheels only (--only-binary=:all:),
# except antlr4-python3-runtime 4.9.3 (needed by omegaconf/hydra-core), which PyPI has only as an
# sdist: it is built here with `pip wheel` (pure Python, so the wheel fits every platform).
# At the end the set is checked by resolving the install offline against OUTDIR alone.
#
# --dry-run       print the pip commands instead of running them
# --packages S    fetch only these requirement specs (and their dependencies) instead of the
#                 harness set, e.g. --packages "omegaconf==2.3.0" (for a quick check or a top-up)
# Environment: PYTHON (the interpreter whose pip runs; default python3), TORCH_SPEC (default
# "torch", e.g. "torch==2.13.0"), EXTRAS (default "test"), WHEELHOUSE_PIP_CONFIG=keep (use the
# local pip config files and PIP_FIND_LINKS, which are ignored by default: see below).
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { printf 'wheelhouse: error: %s\n' "$*" >&2; exit 2; }

DRY=0
PACKAGES=""
ARGS=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --dry-run) DRY=1; shift ;;
    --packages) [[ $# -ge 2 ]] || die "--packages needs a value"; PACKAGES=$2; shift 2 ;;
    --packages=*) PACKAGES=${1#--packages=}; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
[[ ${#ARGS[@]} -eq 3 ]] || { usage >&2; die "expected PYVER PLATFORM OUTDIR, got ${#ARGS[@]} argument(s)"; }
PYVER=${ARGS[0]}
PLATFORM=${ARGS[1]}
OUTDIR=${ARGS[2]}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch}
EXTRAS=${EXTRAS:-test}
ANTLR=antlr4-python3-runtime==4.9.3

# --- Python version: 3.12 / 312 -> 3.12
if [[ $PYVER =~ ^3\.?([0-9]{2})$ ]]; then PYVER="3.${BASH_REMATCH[1]}"; else die "PYVER '$PYVER' is not like 3.12"; fi
(( ${PYVER#3.} >= 10 )) || die "the harness needs Python 3.10+, not $PYVER"

# --- platform tags: the given one plus the older manylinux tags of its architecture
case $PLATFORM in
  x86_64|aarch64) PLATFORM=manylinux_2_28_$PLATFORM ;;
  linux_x86_64|linux_aarch64) PLATFORM=manylinux_2_28_${PLATFORM#linux_} ;;
esac
PLAT_ARGS=(--platform "$PLATFORM")
if [[ $PLATFORM =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
  glibc=${BASH_REMATCH[1]} arch=${BASH_REMATCH[2]}
  for ((g = glibc - 1; g >= 17; g--)); do PLAT_ARGS+=(--platform "manylinux_2_${g}_$arch"); done
  PLAT_ARGS+=(--platform "manylinux2014_$arch")
  [[ $arch == x86_64 ]] && PLAT_ARGS+=(--platform manylinux2010_x86_64 --platform manylinux1_x86_64)
elif [[ $PLATFORM =~ ^manylinux2014_(.+)$ ]]; then
  arch=${BASH_REMATCH[1]}
  PLAT_ARGS+=(--platform "manylinux_2_17_$arch")
fi
TARGET=(--only-binary=:all: --python-version "$PYVER" --implementation cp "${PLAT_ARGS[@]}")
# Local pip config files and PIP_FIND_LINKS are ignored: a find-links folder of wheels built for
# THIS machine (e.g. a CPU torch with a +cpu label, which sorts above PyPI's build) must never
# stand in for the target's. PIP_INDEX_URL / PIP_EXTRA_INDEX_URL from the environment still apply.
# WHEELHOUSE_PIP_CONFIG=keep uses the local pip configuration as it is.
if [[ ${WHEELHOUSE_PIP_CONFIG:-} == keep ]]; then
  PIP=("$PYTHON" -m pip)
else
  PIP=(env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip)
fi
QUIET=(-q --disable-pip-version-check --progress-bar off)

run() {  # print, then run unless --dry-run
  printf '+'; printf ' %q' "$@"; printf '\n'
  if [[ $DRY == 0 ]]; then "$@"; fi
}

if [[ $DRY == 1 ]]; then
  OUTDIR_ABS=$OUTDIR
else
  mkdir -p "$OUTDIR"
  OUTDIR_ABS=$(cd "$OUTDIR" && pwd)
fi
before=$(ls "$OUTDIR_ABS" 2>/dev/null | sort || true)

# 1. wheels built here: antlr (sdist only on PyPI) and, for the full set, the harness itself
run "${PIP[@]}" wheel "${QUIET[@]}" --no-deps -w "$OUTDIR_ABS" "$ANTLR"
if [[ -z $PACKAGES ]]; then
  VERSION=$("$PYTHON" -c 'import re,sys; print(re.search(r"(?m)^version\s*=\s*\"([^\"]+)\"", open(sys.argv[1]).read()).group(1))' "$ROOT/pyproject.toml")
  had_build=0; [[ -e $ROOT/build ]] && had_build=1
  run "${PIP[@]}" wheel "${QUIET[@]}" --no-deps -w "$OUTDIR_ABS" "$ROOT"
  [[ $DRY == 1 || $had_build == 1 ]] || rm -rf "$ROOT/build"   # setuptools' in-tree build dir
  REQS=("$TORCH_SPEC" "dsocr-harness[$EXTRAS]==$VERSION" setuptools wheel)
else
  read -r -a REQS <<< "$PACKAGES"
fi

# 2. every other wheel, for the target interpreter and platform. --find-links OUTDIR lets the
#    resolver take the two wheels built above; it replaces any find-links of the local pip
#    config, so a local wheel built for this machine never stands in for the target's.
run "${PIP[@]}" download "${QUIET[@]}" "${TARGET[@]}" --find-links "$OUTDIR_ABS" -d "$OUTDIR_ABS" "${REQS[@]}"

# 3. proof: the same requirements resolve from OUTDIR alone, with no index
run "${PIP[@]}" install "${QUIET[@]}" --dry-run --ignore-installed --no-index --find-links "$OUTDIR_ABS" \
    --target "${TMPDIR:-/tmp}/wheelhouse-check-$$" "${TARGET[@]}" "${REQS[@]}"

if [[ $DRY == 1 ]]; then
  echo "dry run: nothing downloaded (Python $PYVER, $PLATFORM and older tags of its architecture)"
  exit 0
fi
echo "wheelhouse $OUTDIR_ABS for Python $PYVER on $PLATFORM:"
after=$(ls "$OUTDIR_ABS" | sort)
new=$(comm -13 <(echo "$before") <(echo "$after") | grep -c . || true)
(cd "$OUTDIR_ABS" && ls -1 | while read -r f; do
  printf '  %8s  %s\n' "$(du -h -- "$f" | cut -f1)" "$f"
done)
echo "$(echo "$after" | grep -c .) files ($new new), $(du -sh "$OUTDIR_ABS" | cut -f1) in all."
echo "install offline with: pip install --no-index --find-links $OUTDIR_ABS ${REQS[*]}"
