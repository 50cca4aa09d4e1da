#!/usr/bin/env bash
# GPU smoke check, for a machine with CUDA, CuPy and Python 3.12 but no
# internet (the project's H200 device machine).  It installs the two frozen
# packages from the wheels `make setup` built here (carry build/wheels), then
# runs scripts/gpu_smoke.py and the tests marked gpu.
#
#   bash scripts/gpu_smoke.sh            # from the repository root
#
# Everything else it needs (numpy, scipy, cupy, ml_dtypes, pytest,
# matplotlib, opencv, Pillow) is expected on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c 'import chainer' 2>/dev/null; then
    ls build/wheels/chainer-7.8.1-*.whl build/wheels/chainercv-0.13.1-*.whl
    python3 -m pip install -q --no-index --no-deps --no-compile \
        --target /tmp/site build/wheels/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
python3 scripts/gpu_smoke.py "$@"
python3 -m pytest -q -m gpu tests -p no:cacheprovider
python3 scripts/benchmark_statistics.py --device gpu
