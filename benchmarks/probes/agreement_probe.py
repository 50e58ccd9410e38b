"""How often a shallow readout agrees with the full-depth one, per factory ``agreement`` setting (CPU).

The speed targets of LoopSpec assume an agreement-controlled checkpoint (>= 95 % of first proposals
accepted). This picks the setting without a GPU: for each ``--agreement`` it makes the shape's
checkpoint, runs the reference model (``vllm_loop.reference``) over random tokens in bf16 and in fp32,
and prints the share of positions whose argmax at depth d1 (and d2) equals the argmax at depth R --
under greedy decoding, the first- (second-) proposal acceptance rate on teacher-forced text.

    python benchmarks/probes/agreement_probe.py --shape ouro-1.4b --agreement 0.005 0.002 0.001
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: loopspec_speed
from loopspec_speed import SHAPES, make_shape_checkpoint  # noqa: E402
from vllm_loop.reference import load_reference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="ouro-1.4b")
    ap.add_argument("--agreement", nargs="+", required=True)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()
    spec = SHAPES[args.shape][3]
    d1, d2 = spec["d1"], spec["d2"]
    tokens = None  # the same random text for every setting
    for agreement in args.agreement:
        folder = Path(tempfile.mkdtemp()) / args.shape
        make_shape_checkpoint(args.shape, folder, agreement)
        if tokens is None:
            vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
            tokens = torch.randint(0, vocab, (args.tokens,), generator=torch.Generator().manual_seed(0))
        for dtype in (torch.bfloat16, torch.float32):
            ref = load_reference(folder, dtype=dtype)
            t0 = time.time()
            out = ref.forward_depths(tokens, depths=[d1, d2, ref.depth])
            final = out[ref.depth].argmax(-1)
            row = {"shape": args.shape, "agreement": float(agreement), "dtype": str(dtype).removeprefix("torch."),
                   "positions": args.tokens, "R": ref.depth,
                   f"agree_d{d1}": round((out[d1].argmax(-1) == final).float().mean().item(), 3),
                   f"agree_d{d2}": round((out[d2].argmax(-1) == final).float().mean().item(), 3),
                   "seconds": round(time.time() - t0, 1)}
            print(json.dumps(row), flush=True)
            del ref, out
        shutil.rmtree(folder.parent)


if __name__ == "__main__":
    main()
