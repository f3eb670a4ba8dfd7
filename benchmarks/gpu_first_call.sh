#!/bin/sh
# The project's first contact with a GPU in one call (benchmarks/gpu_first_call.py says what it measures):
#
#   benchmarks/gpu_first_call.sh OUT_DIR [--deadline 530] [--dry-run]
#
# From a bare node without network: pretrainer is installed from the wheels carried in the cache dir
# (FIRST_CALL_CACHE, default .cache/first-call; `python benchmarks/gpu_first_call.py --pack` makes it)
# with the documented offline install (docs/installing.md#offline), or, where that cannot write to the
# site's environment, the wheels go to a private folder on PYTHONPATH. Then every phase, within the
# deadline, counted from this script's start. PYTHON picks the interpreter (default python3).
started=$(date +%s)
cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python3}
cache=${FIRST_CALL_CACHE:-.cache/first-call}
if ! "$PYTHON" -c "import pretrainer" 2>/dev/null; then
    if [ -d "$cache/wheels" ]; then
        echo "installing pretrainer offline from $cache/wheels"
        if ! "$PYTHON" -m pip install --quiet --no-index --find-links "$cache/wheels" -e .; then
            echo "the offline install could not write here; the wheels go to /tmp/pretrainer-site instead"
            wheels=$(ls "$cache"/wheels/*.whl | grep -v '/setuptools-')
            # shellcheck disable=SC2086 (one word per wheel)
            "$PYTHON" -m pip install --quiet --no-index --no-deps --target /tmp/pretrainer-site $wheels || exit 2
            PYTHONPATH=/tmp/pretrainer-site${PYTHONPATH:+:$PYTHONPATH}
        fi
    fi
    PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}  # the tree itself, installed or not
    export PYTHONPATH
fi
exec "$PYTHON" benchmarks/gpu_first_call.py --started-at "$started" --cache "$cache" "$@"
