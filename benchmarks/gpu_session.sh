#!/usr/bin/env bash
# What a session that is lent a GPU runs, in as few device calls as possible.
#
#   bash benchmarks/gpu_session.sh versions tests      # versions, graphs test, then the suite
#   bash benchmarks/gpu_session.sh kernels allreduce    # benchmarks (JSON under $OUT)
#   bash benchmarks/gpu_session.sh training report      # report: kernels.report --hardware
#
# Every stage writes its log (and JSON, for benchmarks) under $OUT (default /tmp/gpu-out),
# with a time limit of its own so that one stuck stage cannot eat the whole call.
# Real CUDA only: NUMBA_ENABLE_CUDASIM=0 everywhere.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
export NUMBA_ENABLE_CUDASIM=0 MIRRORED_OFFLINE=1 MPLBACKEND=Agg PYTHONUNBUFFERED=1
# ptxas for kernels.report and the compile tests: a CUDA toolkit's, where no wheel brings one.
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"
PY="${PYTHON:-python3}"
# Wheels carried to the machine in .whl/ (e.g. numpy<2.5, which numba-cuda 0.30 needs: numpy
# 2.5 removed np.row_stack, which numba-cuda's CUDA target imports on its first compile).
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# Per-stage time limits (seconds); override with e.g. TESTS_S=300.
: "${TESTS_S:=330}" "${KERNELS_S:=200}" "${ALLREDUCE_S:=200}" "${TRAINING_S:=420}" "${XDIST:=12}"

stage() {  # stage NAME SECONDS CMD...: run with a limit, log to $OUT/NAME.log, say how it ended
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
}

for what in "$@"; do
  case "$what" in
    versions)
      { nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
        "$PY" - <<'PYEOF'
import importlib.metadata as md, platform
for d in ("numpy", "numba", "numba-cuda", "llvmlite", "cuda-bindings", "cuda-core", "cuda-toolkit",
          "nvidia-cuda-nvcc-cu12", "nvidia-cuda-nvrtc", "cupy-cuda13x", "torch", "mpi4py", "h5py",
          "pytest", "pytest-xdist", "pytest-timeout", "nbclient", "hypothesis"):
    try:
        print(f"{d:22s} {md.version(d)}")
    except md.PackageNotFoundError:
        print(f"{d:22s} (not installed)")
print("python", platform.python_version())
from numba import cuda
print("numba.cuda.implementation:", getattr(cuda, "implementation", None))
print("cuda.is_available():", cuda.is_available())
cuda.detect()
print("driver:", cuda.cudadrv.driver.driver.get_version(), "runtime:", cuda.runtime.get_version())
PYEOF
      } > "$OUT/versions.log" 2>&1
      cat "$OUT/versions.log" ;;
    graphs)
      stage graphs 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_graphs.py ;;
    tests)
      stage graphs 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_graphs.py
      stage tests "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider -n "$XDIST" --timeout "${TEST_TIMEOUT:-120}" -rfEs ;;
    report)
      stage report 240 "$PY" -m kernels.report --hardware ;;
    kernels)
      stage kernels "$KERNELS_S" "$PY" -m benchmarks.kernels --out "$OUT/kernels.json" ${KERNELS_ARGS:-} ;;
    allreduce)
      stage allreduce "$ALLREDUCE_S" "$PY" -m benchmarks.allreduce --out "$OUT/allreduce.json" ${ALLREDUCE_ARGS:-} ;;
    training)
      stage training "$TRAINING_S" "$PY" -m benchmarks.training --out "$OUT/training.json" ${TRAINING_ARGS:-} ;;
    *) echo "unknown stage $what"; exit 2 ;;
  esac
done
