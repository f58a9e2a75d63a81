# Sourced by scripts/test and .ci/run: the workspace minus the plugins that
# need a toolkit this machine kind lacks (CUDA) or another OS (Metal).
SDHOST_PACKAGES=(--workspace --exclude sdhost-plugin-cuda --exclude sdhost-plugin-metal)
