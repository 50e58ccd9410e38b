"""``python -m vllm_loop.tune CHECKPOINT --prompts FILE``: pick LoopSpec depths (d1, d2) for a model.

Measures TV(p_r, p_R) and greedy agreement at every depth r on the model's own continuations of the
prompts (plain-PyTorch reference model, CPU is fine for small models), fits the power-law envelope
beta * r^-alpha, and prints Theorem 2's optimum and the best valid integer schedule. The paper
measured with --temperature 1.0 --top-p 0.7.

Prompt files: ``.jsonl`` (one object per line with "prompt"/"text", or "token_ids"), ``.json`` (a
list of strings or of token-id lists), anything else: one prompt per non-empty line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from vllm_loop.cli import OneLineArgumentParser
from vllm_loop.loopspec.proposals import SamplingParams
from vllm_loop.loopspec.tune import format_profile, format_result, measure_depth_profile, plot_fit, tune_profile


def read_prompts(path: Path) -> list:
    """Strings or token-id lists, in file order."""
    text = path.read_text()
    if path.suffix == ".json":
        items = json.loads(text)
        if not isinstance(items, list):
            raise ValueError(f"{path}: expected a JSON list of prompts")
        return items
    if path.suffix == ".jsonl":
        items = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            for key in ("token_ids", "prompt_token_ids", "prompt", "text"):
                if key in obj:
                    items.append(obj[key])
                    break
            else:
                raise ValueError(f"{path}:{n}: expected a 'prompt', 'text' or 'token_ids' field")
        return items
    return [line for line in text.splitlines() if line.strip()]


def encode_prompts(items: list, checkpoint: Path) -> list[list[int]]:
    tok = None
    out = []
    for item in items:
        if isinstance(item, list):
            out.append([int(t) for t in item])
            continue
        if tok is None:
            from tokenizers import Tokenizer

            tok_file = checkpoint / "tokenizer.json"
            if not tok_file.exists():
                raise ValueError(f"{checkpoint} has no tokenizer.json: give prompts as token ids instead")
            tok = Tokenizer.from_file(str(tok_file))
        out.append(tok.encode(item).ids)
    return [ids for ids in out if ids]


def main(argv: list[str] | None = None) -> int:
    ap = OneLineArgumentParser(
        prog="python -m vllm_loop.tune",
        description="Pick LoopSpec proposal depths (d1, d2) for a looped model from its measured TV decay.",
    )
    ap.add_argument("checkpoint", type=Path, help="Hugging Face folder of a looped model (Ouro, Huginn, Raven)")
    ap.add_argument("--prompts", type=Path, required=True, help="prompt file (.jsonl, .json or text lines)")
    ap.add_argument("--depth", type=int, default=None, help="R: loop count to run (default: the checkpoint's)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="continuation length per prompt (default 32)")
    ap.add_argument("--max-prompts", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (TV of one-hot argmaxes)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--positions", choices=("generated", "prompt"), default="generated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG of the fit")
    ap.add_argument("--json", type=Path, default=None, help="write all numbers as JSON")
    args = ap.parse_args(argv)

    try:
        if not args.checkpoint.is_dir():
            raise ValueError(f"CHECKPOINT {args.checkpoint}: not a folder")
        if not args.prompts.is_file():
            raise ValueError(f"--prompts {args.prompts}: no such file")
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        prompts = encode_prompts(read_prompts(args.prompts), args.checkpoint)[: args.max_prompts]
        if not prompts:
            raise ValueError(f"--prompts {args.prompts}: no prompts")
        from vllm_loop.reference import load_reference

        model = load_reference(str(args.checkpoint), depth=args.depth)
        profile = measure_depth_profile(
            model, prompts, params, args.max_new_tokens, seed=args.seed, positions=args.positions
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = tune_profile(profile)
    except ValueError as e:  # e.g. every intermediate depth already agrees with depth R
        print(format_profile(profile))
        print(f"error: cannot fit the envelope: {e}", file=sys.stderr)
        return 1
    print(format_result(result))
    if args.plot is not None:
        plot_fit(result, args.plot)
        print(f"wrote {args.plot}")
    if args.json is not None:
        args.json.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
