#!/usr/bin/env bash
# Runs a CUDA build of shardplan (scripts/build-cuda.sh) on a GPU machine whose CUDA and
# NCCL libraries come with PyTorch's pip packages (nvidia/cu13, nvidia/nccl under its
# site-packages):
#
#   scripts/run-cuda.sh [BINARY] -- train --model ... --parallel ... --device cuda
#
# PYTHON picks the interpreter whose packages to use (default python3).
set -euo pipefail
BIN=target/cuda/release/shardplan
if [ "${1:-}" != "--" ] && [ $# -gt 0 ]; then BIN=$1; shift; fi
[ "${1:-}" = "--" ] && shift
PY=${PYTHON:-python3}
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda.so.1' && [ ! -e /usr/lib/x86_64-linux-gnu/libcuda.so.1 ]; then
  echo "error: no NVIDIA driver here (libcuda.so.1 not found): this CUDA build needs a GPU machine; use a default build with --device cpu" >&2
  exit 2
fi
SP=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for d in "$SP/nvidia/cu13/lib" "$SP/nvidia/nccl/lib"; do
  [ -d "$d" ] || { echo "error: $d not found: install PyTorch with CUDA 13 wheels for $PY, or set PYTHON" >&2; exit 2; }
done
export LD_LIBRARY_PATH=$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# cuDNN (the flash attention of `--kernels native`) is opened at run time from its package.
[ -d "$SP/nvidia/cudnn/lib" ] && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$SP/nvidia/cudnn/lib
exec "$BIN" "$@"
