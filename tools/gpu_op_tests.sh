#!/usr/bin/env bash
# The custom ops' CUDA tests, on a machine with an NVIDIA GPU, nvcc and python3-venv:
#
#   tools/gpu_op_tests.sh            # fresh venv build/venv-gpu (.venv is left alone)
#   tools/gpu_op_tests.sh --existing # swap onnxruntime for onnxruntime-gpu in .venv itself
#
# Installs onnxruntime-gpu at the version of the CPU onnxruntime the project is tested with
# (ORT_VERSION overrides; the newest release if that version has no GPU wheel), builds the
# library with the CUDA kernels (--cuda ON) and runs tests/test_cuda_kernels.py (the kernels
# through a C shim, with nvcc), tests/test_ops_cuda.py and tests/test_fp4_op.py.
# CSA2ONNX_REQUIRE_GPU=1 makes the CUDA tests fail instead of skip when no GPU, no CUDA
# provider or no CUDA kernel is found. Needs the network for pip.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=fresh
case "${1:-}" in
  "") ;;
  --existing) mode=existing ;;
  *) echo "usage: $0 [--existing]" >&2; exit 2 ;;
esac

if command -v nvidia-smi >/dev/null; then
  nvidia-smi -L
else
  echo "warning: nvidia-smi not found; the CUDA tests will fail if no GPU is usable" >&2
fi
command -v nvcc >/dev/null || { echo "error: nvcc not found (needed for --cuda ON)" >&2; exit 1; }

# The version to match: the CPU wheel in .venv, else the one pip would pick for the project.
if [[ -z "${ORT_VERSION:-}" && -x .venv/bin/python ]]; then
  ORT_VERSION=$(.venv/bin/python -c 'import onnxruntime; print(onnxruntime.__version__)' \
                2>/dev/null || true)
fi

if [[ $mode == fresh ]]; then
  venv=${GPU_VENV:-build/venv-gpu}  # under build/: git ignores it
  "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -e '.[test]'
else
  venv=.venv
  [[ -x $venv/bin/python ]] || make setup
fi
py=$venv/bin/python

# onnxruntime and onnxruntime-gpu install the same package: only one may be present.
"$py" -m pip uninstall -q -y onnxruntime onnxruntime-gpu >/dev/null 2>&1 || true
# The extras pull CUDA and cuDNN runtime wheels (onnxruntime.preload_dlls loads them);
# pip only warns if a release does not have them.
if [[ -n "${ORT_VERSION:-}" ]] &&
   "$py" -m pip install -q "onnxruntime-gpu[cuda,cudnn]==$ORT_VERSION"; then
  :
else
  echo "onnxruntime-gpu==${ORT_VERSION:-?} is not available; installing the newest" >&2
  "$py" -m pip install -q "onnxruntime-gpu[cuda,cudnn]"
fi
"$py" - <<'EOF'
import onnxruntime as ort
try:
    ort.preload_dlls()  # CUDA/cuDNN from the nvidia-* wheels; system ones work too
except Exception as e:
    print("preload_dlls:", e)
print("onnxruntime", ort.__version__, ort.get_available_providers())
EOF

# Same lock as `make setup`: other builds may share custom_ops/build.
flock /tmp/csa_build.lock "$py" custom_ops/build.py --cuda ON

CSA2ONNX_REQUIRE_GPU=1 "$py" -m pytest tests/test_cuda_kernels.py tests/test_ops_cuda.py \
  tests/test_fp4_op.py -q -rs
