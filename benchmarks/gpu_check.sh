#!/usr/bin/env bash
# The GPU check (issue 62) on a machine that has Python 3.12 with PyTorch (CUDA), Lightning, timm, torchmetrics and
# peft but not necessarily coretune's other dependencies, offline. Run from anywhere in the repository:
#
#   benchmarks/gpu_check.sh wheels      # beforehand, with network: benchmarks/gpu_wheels.txt into wheels/gpu (ignored)
#   benchmarks/gpu_check.sh [ARGS...]   # on the GPU machine: a venv over its packages, the wheels and coretune
#                                       # (pip --no-deps --no-index), then benchmarks/gpu_check.py ARGS (e.g. --out DIR)
#
# PYTHON (default python3) is the machine's Python with PyTorch; GPU_CHECK_VENV (default /tmp/coretune-gpu-check) the
# venv made. The venv sees PYTHON's packages, pip included, even where PYTHON is itself a venv (a plain
# --system-site-packages venv would see only the base interpreter's): a .pth file adds PYTHON's site-packages after
# the venv's own, where the wheels and coretune go.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=wheels/gpu
VENV=${GPU_CHECK_VENV:-/tmp/coretune-gpu-check}

if [[ "${1:-}" == wheels ]]; then
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d "$WHEELS" -r benchmarks/gpu_wheels.txt
    ls "$WHEELS" && du -sh "$WHEELS"
    exit 0
fi

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if (( ${#wheels[@]} == 0 )); then
    echo "gpu_check.sh: no wheels in $WHEELS: run 'benchmarks/gpu_check.sh wheels' on a machine with network first" >&2
    exit 2
fi
start=$SECONDS
rm -rf "$VENV"
"$PYTHON" -m venv --system-site-packages --without-pip "$VENV"  # pip too comes from PYTHON's packages (no ensurepip)
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PYTHON" -c 'import site; [print(f"import site; site.addsitedir({d!r})") for d in site.getsitepackages()]' \
    > "$site/zz-machine-packages.pth"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile "${wheels[@]}"
leftovers=(); for d in build src/coretune.egg-info; do [[ -e $d ]] || leftovers+=("$d"); done
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-build-isolation .
rm -rf "${leftovers[@]}"  # the in-tree build's folders, unless they were there before
echo "gpu_check.sh: coretune and ${#wheels[@]} wheels installed in $((SECONDS - start)) s" >&2
exec "$VENV/bin/python" benchmarks/gpu_check.py "$@"
