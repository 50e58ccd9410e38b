"""benchmarks/loopspec_speed.py end to end on the CPU: one LoopSpec engine on the tiny Ouro shape (~1 min)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "loopspec_speed.py"


def test_a_lanes_auto_run_writes_its_row_and_a_fresh_policy_trace(tmp_path):
    """With ``--policy-trace`` the LoopSpec system's engine writes one JSON line per engine step beside
    ``--out``; at 2 requests the policy tried both modes, so samples of both appear, and each mode's steps are at
    least those the engine's counters saw over the long run; an older trace at that path is replaced, not
    appended to."""
    out = tmp_path / "speed.json"
    trace = tmp_path / "speed.loopspec-auto.trace.jsonl"
    trace.write_text("an older run's line\n")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--shape", "tiny-ouro", "--systems", "loopspec-auto",
                           "--concurrency", "2", "--runs", "1", "--policy-trace", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["table"]
    assert row["system"] == "loopspec-auto" and row["concurrency"] == 2 and row["tok_s"] > 0
    lines = [json.loads(line) for line in trace.read_text().splitlines()]  # the older line would not parse
    assert all({"lanes", "rows", "tokens", "seconds", "sample", "warmup", "context", "rates"} <= set(x) for x in lines)
    assert {x["lanes"] for x in lines if x["rows"] == 2 and x["sample"]} == {True, False}
    # the trace has every wave's steps (warm-up, first token, short and long runs); the counters the long run's
    assert sum(x["lanes"] for x in lines) >= row["lane_steps"]
    assert sum(not x["lanes"] for x in lines) >= row["plain_steps"]
