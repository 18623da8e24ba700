#!/usr/bin/env bash
# The Megatron engine's tests against megatron-core 0.19 (MCORE, default 0.19.2) on a machine whose Python
# is older than 3.12 (this project's CI and development machines: Python 3.11, the one Python for which a CPU
# build of torch can be installed here; PyPI's Linux torch for 3.12 is the CUDA build).
#
# 0.17+ declare Python >= 3.12 and ship only cp312 wheels, so pip will not install them here. Their Python
# source runs on 3.11 all the same (all but megatron/core/datasets' compiled helper, which the engine does not
# use), so this script unpacks the wheel into a temporary folder ahead of the installed 0.16 on PYTHONPATH,
# with triton (which 0.19 imports unguarded; MCORE_TRITON, default 3.7.1, the one torch 2.13 pins), and runs
# the quick and slow Megatron tests: parity with the reference, the shim's tripwire (a torch.cuda call it
# does not cover fails), MoE, the census and the views. On Python 3.12 pip installs 0.19 itself (pyproject):
# plain `pytest -q tests/test_megatron*.py` there.
#
# Run from the repository root inside the project's venv (`pip install -e '.[dev]'` done):
#   bash scripts/megatron_next_cpu.sh            (7 min: 89 tests passed on 2 cores at load 10-24; pytest arguments
#   bash scripts/megatron_next_cpu.sh -k tp2      after the script's name replace the default test files)
set -euo pipefail
MCORE=${MCORE:-0.19.2}
MCORE_TRITON=${MCORE_TRITON:-3.7.1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: "megatron-core==$MCORE" -d "$work/dl"
python -m zipfile -e "$work"/dl/megatron_core-*.whl "$work/src"
python -c 'import triton' 2>/dev/null || python -m pip install -q --no-deps --target "$work/triton" "triton==$MCORE_TRITON"
export PYTHONPATH="$work/src:$work/triton:$PWD"
python -c "import megatron.core as m; assert m.__version__.startswith('$MCORE'), m.__version__; print('megatron-core', m.__version__)"
if [ $# -eq 0 ]; then
    set -- tests/test_megatron.py tests/test_megatron_facts.py tests/test_megatron_memory.py \
        tests/test_megatron_moe.py tests/test_megatron_moe_config.py tests/test_megatron_views.py
fi
# The one test that must fail here: the installed pins pick 0.16 for this Python (that is what it checks).
python -m pytest -q -p no:cacheprovider --deselect \
    tests/test_megatron_facts.py::test_the_installed_megatron_core_is_the_one_this_python_asks_for "$@"
