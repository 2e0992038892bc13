#!/usr/bin/env bash
# Assembles a CUDA 13.0 toolkit from PyPI wheels, for building shardplan's `cuda` feature on
# a machine without a GPU or a system CUDA. Prints the folder to use as CUDA_HOME.
#
#   scripts/cuda-toolkit.sh [DEST]      (default: target/cuda-toolkit)
#
# Pinned to 13.0.x: the GPU machines' driver is CUDA 13.0, and a newer nvcc writes PTX that
# such a driver may refuse. cuBLAS, cuRAND, NVRTC and NCCL are the versions PyTorch 2.11+cu130
# ships, which is what the binary finds on the GPU machine at run time (scripts/run-cuda.sh).
# No wheel ships the driver library (libcuda.so.1), so a link-time stub is made from the
# `cu*` names in cuda.h; the real one comes with the GPU's driver.
# cuDNN contributes headers only (its 366 MB wheel is unpacked for `include/`): the flash
# attention shim (executor/cudnn/attn.cpp) is built over cudnn-frontend's header-only graph
# API and opens libcudnn.so.9 at run time, from the GPU machine's PyTorch packages.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-target/cuda-toolkit}
PY=${PYTHON:-python3}
WHEELS=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-nvrtc==13.0.88
  nvidia-cuda-cccl==13.0.85
  nvidia-cublas==13.1.0.3
  nvidia-curand==10.4.0.35
  nvidia-nccl-cu13==2.28.9
)
mkdir -p "$DEST/wheels" "$DEST/root"
platforms=()
for p in manylinux2010 manylinux_2_12 manylinux2014 manylinux_2_17 manylinux_2_18 manylinux_2_27 manylinux_2_28; do
  platforms+=(--platform "${p}_x86_64")
done
if [ ! -f "$DEST/root/.done" ]; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: "${platforms[@]}" -d "$DEST/wheels" "${WHEELS[@]}"
  for w in "$DEST"/wheels/*.whl; do
    "$PY" -m zipfile -e "$w" "$DEST/root"
  done
  touch "$DEST/root/.done"
fi
# cuDNN 9.19 (what PyTorch 2.11+cu130 pins, so what the GPU machines load) and
# cudnn-frontend 1.32: headers only, into $DEST/cudnn/{include,frontend/include}.
if [ ! -f "$DEST/cudnn/.done" ]; then
  mkdir -p "$DEST/cudnn-wheels" "$DEST/cudnn"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 312 "${platforms[@]}" \
    -d "$DEST/cudnn-wheels" nvidia-cudnn-cu13==9.19.0.56 nvidia-cudnn-frontend==1.32.0
  "$PY" - "$DEST" <<'PY'
import glob, os, sys, zipfile
dest = sys.argv[1]
for wheel, prefix, out in [("nvidia_cudnn_cu13-", "nvidia/cudnn/include/", "include"),
                           ("nvidia_cudnn_frontend-", "include/", "frontend/include")]:
    [path] = glob.glob(os.path.join(dest, "cudnn-wheels", wheel + "*.whl"))
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            if name.startswith(prefix) and not name.endswith("/"):
                target = os.path.join(dest, "cudnn", out, name[len(prefix):])
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with z.open(name) as src, open(target, "wb") as dst:
                    dst.write(src.read())
PY
  rm -rf "$DEST/cudnn-wheels"
  [ -f "$DEST/cudnn/include/cudnn.h" ] && [ -f "$DEST/cudnn/frontend/include/cudnn_frontend.h" ] \
    || { echo "error: no cudnn.h / cudnn_frontend.h after unpacking the cuDNN wheels" >&2; exit 1; }
  touch "$DEST/cudnn/.done"
fi
CUDA=$DEST/root/nvidia/cu13
NCCL=$DEST/root/nvidia/nccl
[ -f "$CUDA/bin/nvcc" ] || { echo "error: no nvcc under $CUDA/bin after unpacking the wheels" >&2; exit 1; }
# zipfile does not keep permissions.
chmod +x "$CUDA"/bin/* "$CUDA"/bin/crt/* "$CUDA"/nvvm/bin/* 2>/dev/null || true
ln -sfn lib "$CUDA/lib64"
# Unversioned names for the linker, next to the versioned ones the wheels ship.
for so in "$CUDA"/lib/lib*.so.[0-9]* "$NCCL"/lib/lib*.so.[0-9]*; do
  base=${so%%.so.*}.so
  [ -e "$base" ] || ln -sfn "$(basename "$so")" "$base"
done
[ -e "$CUDA/lib/libnccl.so" ] || ln -sfn "$(cd "$NCCL/lib" && pwd)/libnccl.so.2" "$CUDA/lib/libnccl.so"
ln -sfn ../../nccl/include/nccl.h "$CUDA/include/nccl.h" 2>/dev/null || true
# The driver stub: every cu* function named in cuda.h, with the soname of the real library.
if [ ! -f "$CUDA/lib/stubs/libcuda.so" ]; then
  mkdir -p "$CUDA/lib/stubs"
  grep -oE '\bcu[A-Z][A-Za-z0-9_]*\b' "$CUDA/include/cuda.h" | sort -u \
    | awk '{ print "int " $1 "(void) { return 999; }" }' > "$CUDA/lib/stubs/libcuda.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$CUDA/lib/stubs/libcuda.so" "$CUDA/lib/stubs/libcuda.c"
fi
ln -sfn stubs/libcuda.so "$CUDA/lib/libcuda.so"
echo "$(cd "$CUDA" && pwd)"
