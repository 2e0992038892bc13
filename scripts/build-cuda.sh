#!/usr/bin/env bash
# Builds shardplan with the `cuda` feature on a machine without a GPU or a system CUDA:
# the CUDA 13.0 toolkit comes from PyPI wheels (scripts/cuda-toolkit.sh), kernels are
# compiled for compute capability 90 (H100 / H200). Prints the binary's path.
#
#   scripts/build-cuda.sh [--dev] [--check | --clippy [CARGO ARGS]]
#     --check: `cargo check` of every target; --clippy: `cargo clippy -D warnings` of every
#     target (the CUDA-only code paths); neither builds the binary
#     --dev: what CI runs, to see that the feature compiles and links: the dev profile in
#     target/ (the dependencies the default build made there are reused, where the release
#     build in target/cuda compiles all of them again) and device code compiled with little
#     optimisation (nvcc -Xcicc -O1 -Xptxas -O0; candle's kernels take about a third of the
#     time). The binary is for the checks that need no GPU; build without --dev for a GPU.
#
# Run the binary on the GPU machine with scripts/run-cuda.sh, which points the loader at
# the CUDA and NCCL libraries of that machine's PyTorch pip packages.
set -euo pipefail
cd "$(dirname "$0")/.."
CUDA_HOME=$(scripts/cuda-toolkit.sh "${CUDA_TOOLKIT_DIR:-target/cuda-toolkit}" | tail -1)
export CUDA_HOME CUDA_PATH=$CUDA_HOME
export PATH=$CUDA_HOME/bin:$PATH
export NVCC=$CUDA_HOME/bin/nvcc
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
# The cuDNN flash-attention shim's headers (cuDNN 9.19 and cudnn-frontend 1.32, unpacked by
# cuda-toolkit.sh beside the toolkit); libcudnn itself is opened at run time.
TOOLKIT_DIR=${CUDA_TOOLKIT_DIR:-target/cuda-toolkit}
case $TOOLKIT_DIR in /*) ;; *) TOOLKIT_DIR=$PWD/$TOOLKIT_DIR ;; esac
export CUDNN_INCLUDE_DIR=${CUDNN_INCLUDE_DIR:-$TOOLKIT_DIR/cudnn/include}
export CUDNN_FRONTEND_INCLUDE_DIR=${CUDNN_FRONTEND_INCLUDE_DIR:-$TOOLKIT_DIR/cudnn/frontend/include}
# cudarc would otherwise ask `nvcc --version`; pin the API level to the driver's.
export CUDARC_CUDA_VERSION=13000
# Link against the wheels' libraries and the driver stub (the real libcuda.so.1 comes with
# the GPU machine's driver).
export LIBRARY_PATH=$CUDA_HOME/lib:$CUDA_HOME/lib/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}
profile=(--release) dir=release
if [ "${1:-}" = --dev ]; then
  shift
  profile=() dir=debug
  # Flags of the default build, so that its dependencies in target/ are reused (RUSTFLAGS
  # would rebuild them all); cudarc and candle's kernels name the CUDA libraries' folder.
  export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:-} -Xcicc -O1 -Xptxas -O0"
else
  export RUSTFLAGS="${RUSTFLAGS:-} -L native=$CUDA_HOME/lib -L native=$CUDA_HOME/lib/stubs"
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
fi
# Arguments after --check or --clippy go to cargo (CI: `--features mpi`, to lint both).
case "${1:-}" in
  --check) cargo check "${profile[@]}" --features cuda --all-targets "${@:2}"; exit 0 ;;
  --clippy) cargo clippy "${profile[@]}" --features cuda --all-targets "${@:2}" -- -D warnings; exit 0 ;;
  "") ;;
  *) echo "build-cuda.sh: unknown argument \`$1\` (--dev, then --check or --clippy)" >&2; exit 2 ;;
esac
cargo build "${profile[@]}" --features cuda --bin shardplan
echo "${CARGO_TARGET_DIR:-target}/$dir/shardplan"
