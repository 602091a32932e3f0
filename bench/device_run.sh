#!/usr/bin/env bash
# The project's one script for the H200 machine (../shared/docs/device.md). That machine starts bare
# and takes at most 64 MiB per call, so the wheel bundles of ../shared/tools/device-wheels.sh travel
# one per call, back to back:
#   bash bench/device_run.sh install      # in each call, with one bundle carried (.devwheels/<bundle>)
#   bash bench/device_run.sh test         # last call: GPU tests + the end-to-end suite on the GPU
# Results (logs, JSON) go to $OUT (the device tool brings them back) or ./bench/results/device.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/site
OUT=${OUT:-bench/results/device}
mkdir -p "$OUT"

install_bundles() {
  for bundle in .devwheels/*/; do
    ls "$bundle"*.whl >/dev/null 2>&1 || continue
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$bundle"*.whl
    echo "installed $bundle"
  done
  # The tritonserver 2.51 stub ignores PYTHONPATH and needs numpy<2: this .pth line lets it see $SITE
  # first (only where STUB_SITE is set), leaving every other program's numpy alone (triton.md).
  local sp
  sp=$(python3 -c "import site; print(site.getsitepackages()[0])")
  echo "import os, sys; p = os.environ.get('STUB_SITE'); p and sys.path.insert(0, p)" > "$sp/00-stub-site.pth"
}

run_tests() {
  export PYTHONPATH=$SITE STUB_SITE=$SITE PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
  python3 -c "import torch, transformers, numpy; print('torch', torch.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__)" | tee -a "$OUT/device.txt"
  set +e
  UNIFIEDSERVE_TEST_SERVER_LOG="$OUT/tritonserver.log" UNIFIEDSERVE_DUMP_STACKS=1 python3 -m pytest -q \
    --durations=20 ${PYTEST_ARGS:-tests/e2e tests/unit/test_runtime_vs_transformers.py tests/unit/test_shared_tensor.py} \
    2>&1 | tee "$OUT/pytest_gpu.log"
  local rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

case "${1:-}" in
  install) install_bundles ;;
  test) install_bundles; run_tests ;;
  *) echo "usage: $0 install|test" >&2; exit 2 ;;
esac
