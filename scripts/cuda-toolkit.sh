#!/usr/bin/env bash
# Assembles a CUDA 13.0 toolkit from PyPI wheels (no NVIDIA installer needed)
# into DIR (default /opt/cuda-tk) and prints the toolkit root to pass as
# SDHOST_CUDA_ROOT. Versions are those pinned by the meta-package
# cuda-toolkit==13.0.2 (driver 580). About 500 MB of wheels.
#
#   root=$(scripts/cuda-toolkit.sh) && SDHOST_CUDA_ROOT=$root cargo build --release -p sdhost-plugin-cuda
set -euo pipefail
dir=${1:-/opt/cuda-tk}
wheels=$(mktemp -d)
pip download --no-deps -q -d "$wheels" \
  nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cublas==13.1.0.3 >&2
pip install -q --no-deps --no-index --target "$dir" "$wheels"/*.whl >&2
rm -rf "$wheels"
root="$dir/nvidia/cu13"
ln -sfn lib "$root/lib64"                      # nvcc links cudadevrt/cudart_static from lib64
for l in cudart cublas cublasLt; do ln -sf "lib$l.so.13" "$root/lib/lib$l.so"; done
# Link-only stub of the driver API (the real libcuda.so.1 comes with the driver).
mkdir -p "$root/lib/stubs"
syms="cuDeviceGet cuDeviceGetAttribute cuGetErrorString cuMemAddressFree cuMemAddressReserve cuMemCreate
      cuMemGetAllocationGranularity cuMemMap cuMemRelease cuMemSetAccess cuMemUnmap cuInit cuDriverGetVersion
      cuGetProcAddress cuGetProcAddress_v2"
{ for s in $syms; do echo "int $s(void){return 0;}"; done; } > "$root/lib/stubs/cuda_stub.c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$root/lib/stubs/libcuda.so" "$root/lib/stubs/cuda_stub.c"
echo "$root"
