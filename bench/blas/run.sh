#!/bin/sh
# Issue 17, item 5: does ggml's BLAS backend (OpenBLAS) beat the matrix
# kernels sdhost's CPU plugin runs? Builds the pinned ggml with its CPU
# backend for one of sdhost's CPU variants plus the BLAS backend, then times
# SD 1.5's matrix products on each (blas-matmul, matmul.c).
#
#   apt-get install libopenblas-dev cmake      # Debian 12: OpenBLAS 0.3.21
#   bench/blas/run.sh [haswell|icelake|zen4] [threads]
#
# OpenBLAS picks its kernels for the running processor; to time the ones
# an AVX2-only processor would get, set OPENBLAS_CORETYPE=Haswell.
#
# Variants (ggml's GGML_CPU_ALL_VARIANTS feature sets): haswell is the
# default plugin (AVX2, FMA, F16C), icelake adds AVX-512 (+VNNI, VBMI),
# zen4 adds AVX512-BF16 (bf16 products in hardware).
set -eu
variant=${1:-haswell}
threads=${2:-2}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"
cargo build --release -p ggml 2>/dev/null
src=$(grep -h '^cargo:source=' target/release/build/ggml-*/output | head -1 | cut -d= -f2-)
[ -d "$src" ] || { echo "pinned ggml source not found" >&2; exit 1; }
case $variant in
haswell) feats="AVX AVX2 BMI2 FMA F16C" ;;
icelake) feats="AVX AVX2 BMI2 FMA F16C AVX512 AVX512_VBMI AVX512_VNNI" ;;
zen4) feats="AVX AVX2 BMI2 FMA F16C AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16" ;;
*) echo "unknown variant $variant" >&2; exit 2 ;;
esac
flags=""
for f in AVX AVX2 BMI2 FMA F16C AVX_VNNI AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16 AMX_TILE AMX_INT8 AMX_BF16; do
    on=OFF
    for g in $feats; do [ "$g" = "$f" ] && on=ON; done
    flags="$flags -DGGML_$f=$on"
done
build="target/blas-bench/$variant"
mkdir -p target/blas-bench
# shellcheck disable=SC2086
cmake -S "$here" -B "$build" -DGGML_SRC="$src" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_LLAMAFILE=ON -DGGML_OPENMP=ON -DBUILD_SHARED_LIBS=OFF \
    -DGGML_BLAS=ON -DGGML_BLAS_VENDOR=OpenBLAS $flags >"$build.log" 2>&1 ||
    { echo "cmake failed, see $build.log" >&2; exit 1; }
cmake --build "$build" --target blas-matmul -j 2 >>"$build.log" 2>&1 ||
    { echo "build failed, see $build.log" >&2; exit 1; }
echo "variant $variant, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
OPENBLAS_NUM_THREADS=$threads "$build/blas-matmul" "$threads" 3
