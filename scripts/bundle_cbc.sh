#!/usr/bin/env bash
# Packs this Debian machine's COIN-OR CBC (the ILP solver the planner links)
# into a folder that travels with the working tree to a machine without it
# (the GPU machine: no CBC package, no apt). scripts/gpu_check.sh builds the
# whole project there with it (its train_cuda step).
#   bash scripts/bundle_cbc.sh [.gpu-deps/cbc]
# The folder gets include/coin, lib (CBC, CGL, OSI, CLP, CoinUtils and the
# LAPACK/BLAS/gfortran/quadmath/bz2 libraries they load) and pkgconfig files
# whose prefix is relative to themselves. Use it with PKG_CONFIG_PATH=DIR/
# pkgconfig, LIBRARY_PATH=DIR/lib, LD_LIBRARY_PATH=DIR/lib and
# CPLUS_INCLUDE_PATH=DIR/include.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.gpu-deps/cbc}
libdir=/lib/x86_64-linux-gnu
pcdir=/usr/lib/x86_64-linux-gnu/pkgconfig
if [ ! -d /usr/include/coin ]; then
  echo "bundle_cbc: CBC is not installed here (coinor-libcbc-dev: bash scripts/install_deps.sh)" >&2
  exit 1
fi
rm -rf "$out"
mkdir -p "$out/lib" "$out/include" "$out/pkgconfig"
cp -r /usr/include/coin "$out/include/"
for name in Cbc CbcSolver Cgl Clp ClpSolver Osi OsiClp OsiCbc CoinUtils; do
  for f in "$libdir"/lib$name.so*; do [ -e "$f" ] && cp -P "$f" "$out/lib/"; done
done
for f in liblapack.so.3 libblas.so.3 libgfortran.so.5 libquadmath.so.0 libbz2.so.1.0; do
  cp -L "$libdir/$f" "$out/lib/"
done
ln -sf liblapack.so.3 "$out/lib/liblapack.so"
ln -sf libblas.so.3 "$out/lib/libblas.so"
ln -sf libbz2.so.1.0 "$out/lib/libbz2.so"
for pc in cbc cgl clp osi osi-clp osi-cbc coinutils; do
  [ -f "$pcdir/$pc.pc" ] || continue
  sed -e 's|^prefix=.*|prefix=${pcfiledir}/..|' -e 's|^libdir=.*|libdir=${prefix}/lib|' "$pcdir/$pc.pc" >"$out/pkgconfig/$pc.pc"
done
du -sh "$out"
