"""benchmarks/gpu_evidence.sh on a machine without a GPU: its steps expand as documented, and the
pytest parts of `identity` and `gpu-tests` (each sized for a ~10-minute command) select every test
of tests/test_gpu.py exactly once. `python3` is a stub that records the commands the steps run."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_evidence.sh"


def _run(tmp_path, *steps):
    stub = tmp_path / "bin"
    stub.mkdir()
    log = tmp_path / "calls.txt"
    (stub / "python3").write_text(f'#!/bin/bash\nprintf "%q " "$@" >> {shlex.quote(str(log))}\necho >> {shlex.quote(str(log))}\n')
    (stub / "python3").chmod(0o755)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), str(out), *steps], capture_output=True, text=True,
                          env=os.environ | {"PATH": f"{stub}:{os.environ['PATH']}"})
    calls = [shlex.split(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls, (out / "phases.txt").read_text().splitlines()


def _collected(expression: str) -> set[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests/test_gpu.py", "-k", expression], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode in (0, 5), proc.stdout + proc.stderr  # 5: nothing selected
    return {line for line in proc.stdout.splitlines() if line.startswith("tests/test_gpu.py::")}


@pytest.mark.slow  # nine pytest collections in subprocesses
def test_gpu_test_parts_select_every_gpu_test_once(tmp_path):
    proc, calls, phases = _run(tmp_path, "identity", "gpu-tests")
    assert proc.returncode == 0, proc.stderr
    parts = ["identity-ouro", "identity-raven", "kernel-tests", "parity-tests", "raven-parity-tests",
             "nocompile-tests", "async-tests", "other-tests"]
    assert phases[0].endswith("start: " + " ".join(parts))
    assert [p.split()[1:] for p in phases[1:-1]] == [[p, "rc=0"] for p in parts]
    expressions = [c[c.index("-k") + 1] for c in calls]
    assert len(expressions) == len(parts) and all(c[:2] == ["-m", "pytest"] for c in calls)
    selected = [_collected(e) for e in expressions]
    everything = _collected("")
    assert len(everything) > 50 and all(selected), dict(zip(parts, map(len, selected)))
    assert sum(map(len, selected)) == len(everything) and set().union(*selected) == everything
    # the identity parts are the fp32 greedy-identity tests with lane graphs on and off
    assert all("::test_loopspec_greedy_identity_compiled[" in t for t in selected[0] | selected[1])
    assert all("ouro" in t for t in selected[0]) and not any("ouro" in t for t in selected[1])


def test_unknown_step_names_the_allowed_ones(tmp_path):
    proc, calls, phases = _run(tmp_path, "idenity")
    assert calls == [] and phases[-2].endswith("idenity rc=1")
    message = (tmp_path / "out" / "idenity.txt").read_text()
    assert message.startswith("unknown step idenity; allowed:") and "identity-ouro" in message


def test_a_part_named_twice_runs_once(tmp_path):
    # kernels = kernel-tests + merge-sweep, and gpu-tests starts with kernel-tests too
    proc, calls, phases = _run(tmp_path, "kernels", "gpu-tests")
    assert proc.returncode == 0, proc.stderr
    steps = phases[0].split("start: ")[1].split()
    assert steps[:3] == ["kernel-tests", "merge-sweep", "parity-tests"] and steps.count("kernel-tests") == 1
    assert [c[:2] for c in calls].count(["-m", "pytest"]) == len(steps) - 1
    assert ["benchmarks/lane_attention_sweep.py", "--merge"] in [c[:2] for c in calls]
