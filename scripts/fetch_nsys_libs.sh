#!/usr/bin/env bash
# The libraries Nsight Systems' importer (QdstrmImporter) needs and some GPU nodes lack: libdw.so.1
# and libelf.so.1 (elfutils). Without them nsys ends with "Importer error status ... skipping
# importation of the QDSTRM file" and leaves only a .qdstrm.
#
# On a Debian/Ubuntu machine with apt (no root needed), this downloads the .debs into .nsysdeps/debs/
# and unpacks them with dpkg -x into .nsysdeps/root/ (about 2 MB with the .debs; .nsysdeps/ is git-ignored).
# Carry .nsysdeps/ to the GPU node, into the repository root: `python -m harness profile tool=nsys`
# puts its library folder on LD_LIBRARY_PATH (or point HARNESS_NSYS_LIBS at .nsysdeps/root).
#
#   scripts/fetch_nsys_libs.sh [DEST]           # DEST defaults to .nsysdeps
#   EXTRA="libbz2-1.0 liblzma5" scripts/fetch_nsys_libs.sh   # also libdw's compression libraries
#
# The .debs come from this machine's release: the GPU node's glibc must be at least the newest
# GLIBC_x.y the libraries ask for (printed at the end; compare with `ldd --version` there).
set -euo pipefail
DEST=${1:-.nsysdeps}
command -v apt-get >/dev/null && command -v dpkg >/dev/null || {
  echo "error: apt-get and dpkg are needed; fix: run this on a Debian or Ubuntu machine" >&2; exit 2; }

# Debian 13 / Ubuntu 24.04 renamed the packages for 64-bit time_t (libdw1t64, libelf1t64).
pick() { if apt-cache show "$1t64" >/dev/null 2>&1; then echo "$1t64"; else echo "$1"; fi; }
PKGS="$(pick libdw1) $(pick libelf1) ${EXTRA:-}"

mkdir -p "$DEST/debs" "$DEST/root"
(cd "$DEST/debs" && apt-get download $PKGS)
for deb in "$DEST"/debs/*.deb; do dpkg -x "$deb" "$DEST/root"; done

LIBDIR=$(dirname "$(find "$DEST/root" -name 'libdw.so.1' | head -1)")
[ -e "$LIBDIR/libdw.so.1" ] && [ -e "$LIBDIR/libelf.so.1" ] || {
  echo "error: libdw.so.1 / libelf.so.1 not found under $DEST/root; fix: check the packages $PKGS" >&2; exit 2; }
GLIBC=$(objdump -T "$LIBDIR"/libdw.so.1 "$LIBDIR"/libelf.so.1 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1 || true)
echo "packages: $PKGS"
echo "libraries: $LIBDIR ($(du -sh "$DEST" | cut -f1) in $DEST)"
echo "needs: ${GLIBC:-unknown (no objdump)} or newer on the GPU node"
echo "use:   carry $DEST/ into the repository root there, or export HARNESS_NSYS_LIBS=$DEST/root"
