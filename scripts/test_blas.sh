#!/usr/bin/env bash
# The float64 finite-difference checks under each of OpenBLAS's x86 kernels this CPU can run
# (OPENBLAS_CORETYPE): their tolerances come from the step and float64 rounding (ddl_ref/check.py), so they must
# pass whichever kernel sums the products. `make test-blas`; about 3 min per kernel on the 2-core dev machine.
set -euo pipefail
cd "$(dirname "$0")/.."
FILES="tests/test_ref_model.py tests/test_ref_ops.py tests/test_ref_gdn.py tests/test_ref_mtp.py tests/test_ref_ddl.py
  tests/test_mtp_train.py tests/test_chain_attention.py"
kernels="Prescott Nehalem Sandybridge"
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
case "$flags" in *" avx2"*) kernels="$kernels Haswell Zen" ;; esac
case "$flags" in *" avx512f"*) kernels="$kernels SkylakeX" ;; esac
[ "$(uname -m)" = x86_64 ] || kernels="default"
for k in $kernels; do
  echo "== OPENBLAS_CORETYPE=$k"
  if [ "$k" = default ]; then env -u OPENBLAS_CORETYPE .venv/bin/python -m pytest -q -p no:cacheprovider $FILES
  else OPENBLAS_CORETYPE=$k .venv/bin/python -m pytest -q -p no:cacheprovider $FILES; fi
done
