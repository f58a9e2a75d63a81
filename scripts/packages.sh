# Sourced by scripts/test and .ci/run: the workspace minus the plugins that
# need a toolkit this machine kind lacks (CUDA) or another OS (Metal), and the
# stable-diffusion.cpp peer used only for benchmarks (docs/performance.md).
SDHOST_PACKAGES=(--workspace --exclude sdhost-plugin-cuda --exclude sdhost-plugin-metal --exclude sdhost-peer-sdcpp)
