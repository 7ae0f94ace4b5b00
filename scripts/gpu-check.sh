#!/usr/bin/env bash
# The CUDA paths, for real, on a GPU machine: tests/test_gpu.py, then a short GPU benchmark.
#
# For a machine with PyTorch built with CUDA and no network, and no IPython stack (the GPU machine
# lent to this project: one H200, torch 2.11 as last seen, Python 3.12): nbdist runs from this
# checkout (PYTHONPATH), needing only torch, cloudpickle, psutil and pytest there. Wheels of what
# is missing can travel in .whl/ (see docs/contributing.md, "GPU checks"); they are installed first.
# Everything it prints also goes to $OUT (the device tool's output folder) or .artifacts/gpu.
# Finishes within 10 minutes.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-.artifacts/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
exec > >(tee "$OUT/gpu-check.log") 2>&1
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/nbdist-site .whl/*.whl &&
        export PYTHONPATH=/tmp/nbdist-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
"$PY" - <<'PY'
import sys, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.device_count()} GPU(s), NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
for name in ("cloudpickle", "psutil", "pytest"):
    __import__(name)
if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13):
    print(f"note: torch {torch.__version__}: FSDP2 models are kept across a stopped step from torch 2.13 on; "
          "everything else checked here works from torch 2.2")
PY
status=0
timeout 450 "$PY" -m pytest -q -rA -p no:cacheprovider tests/test_gpu.py || status=$?
timeout 120 "$PY" benchmarks/bench_gpu.py || status=$((status ? status : $?))
echo "gpu-check: exit $status"
exit $status
