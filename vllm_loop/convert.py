"""Turn a released COCONUT, CODI or LOTUS checkpoint into a folder this plugin serves.

The released checkpoints carry none of this project's keys: COCONUT and CODI runs leave a training
state dict next to the *base* model's ``config.json`` and tokenizer (``GPT2LMHeadModel`` /
``LlamaForCausalLM``), LOTUS a plain ``LlamaForCausalLM`` folder (or its training ``model.pt``).
Served as they are, they would run as plain GPT-2 / Llama. This writes ``DST`` with:

* ``config.json``: the base config with the latent architecture (``CoconutGPT2LMHeadModel``,
  ``CODILlamaForCausalLM``, ``LotusLlamaForCausalLM``, ...), ``vocab_size`` = the embedding rows,
  a ``latent_spec`` (``vllm_loop/latent/spec.py``) and, for CODI / LOTUS, their ``codi`` / ``lotus``
  settings;
* ``model.safetensors``: the tensors under Hugging Face names (wrapper prefixes ``base_causallm.``
  stripped, training-only tensors such as ``teacher_model.*`` dropped, a tied head stored once);
  CODI keeps its PEFT names and ``prj`` head (the loader folds the LoRA in);
* the tokenizer with the tokens the original code adds at run time (COCONUT / LOTUS:
  ``<|start-latent|>``, ``<|end-latent|>``, ``<|latent|>``; CODI: ``[PAD]`` and, so that every id the
  model can emit has text, ``<|bot|>`` / ``<|eot|>``).

    python -m vllm_loop.convert --family coconut ./coconut-run ./coconut-gpt2
    python -m vllm_loop.convert --family coconut ./checkpoint_6 ./coconut-gpt2 --base ./gpt2
    python -m vllm_loop.convert --family codi ./codi-gpt2-release ./codi-gpt2 --base ./gpt2
    python -m vllm_loop.convert --family lotus ./gsm-lotus-llama3b ./lotus-llama3b

``SRC`` is a folder (weights, and config.json + tokenizer unless ``--base`` gives them) or one
weights file. Settings the released files do not record come from the original repos' defaults
and can be overridden: ``--latent-budget`` (COCONUT: c_thought x max_latent_stage = 6 for GSM8K;
CODI: ``inf_latent_iterations`` = 6; LOTUS: ``n_looped_iters`` = 6), ``--c-thought`` (LOTUS: 25 for
Llama, 13 for GPT-2), ``--lora-alpha`` (CODI: 32), ``--keep-eos`` (CODI run without
``remove_eos``), ``--injection`` (LOTUS: ``add``), ``--max-budget``. CODI's LoRA rank, ``prj``
size and LayerNorm are read from the tensors.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from vllm_loop.cli import OneLineArgumentParser
from vllm_loop.latent.spec import LatentSpec

LATENT_TOKENS = ("<|start-latent|>", "<|end-latent|>", "<|latent|>")  # COCONUT / LOTUS add_tokens order
CODI_TOKENS = ("[PAD]", "<|bot|>", "<|eot|>")  # ids V, V+1, V+2
CODI_PREFIX = "codi.base_model.model."
WRAPPER_PREFIX = "base_causallm."
LORA_TARGETS = {  # the released runs' PEFT target modules, in the order the CODI scripts list them
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "gate_proj"),
}
ARCHITECTURES = {
    ("coconut", "gpt2"): "CoconutGPT2LMHeadModel", ("coconut", "llama"): "CoconutLlamaForCausalLM",
    ("codi", "gpt2"): "CODIGPT2LMHeadModel", ("codi", "llama"): "CODILlamaForCausalLM",
    ("lotus", "gpt2"): "LotusGPT2LMHeadModel", ("lotus", "llama"): "LotusLlamaForCausalLM",
}
FAMILIES = ("coconut", "codi", "lotus")


class ConvertError(ValueError):
    """Bad input; the message names what is wrong."""


# -- reading -------------------------------------------------------------------------------------------
def weight_files(src: Path) -> list[Path]:
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise ConvertError(f"SRC {src} does not exist")
    for pattern in ("*.safetensors", "pytorch_model*.bin", "checkpoint_*", "*.pt", "*.bin"):
        found = sorted(p for p in src.glob(pattern) if p.is_file())
        if found:
            return found
    raise ConvertError(f"SRC {src} holds no weights (*.safetensors, pytorch_model.bin, checkpoint_*, *.pt)")


def load_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file

            out.update(load_file(str(f)))
        else:
            state = torch.load(str(f), map_location="cpu", weights_only=True)
            if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
                state = state["state_dict"]
            out.update({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
    return out


def _base_kind(config: dict) -> str:
    kind = config.get("model_type")
    if kind not in ("gpt2", "llama"):
        raise ConvertError(f"config.json model_type={kind!r}: the released latent models are GPT-2 or Llama")
    return kind


def _strip_wrapper(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A training wrapper's state dict (``base_causallm.`` + HF names, beside training-only modules
    such as ``teacher_model.*``): keep the base model's tensors under their HF names."""
    if not any(k.startswith(WRAPPER_PREFIX) for k in tensors):
        return dict(tensors)
    return {k[len(WRAPPER_PREFIX):]: v for k, v in tensors.items() if k.startswith(WRAPPER_PREFIX)}


def _embedding_rows(tensors: dict[str, torch.Tensor], kind: str, prefix: str = "") -> int:
    name = prefix + ("transformer.wte.weight" if kind == "gpt2" else "model.embed_tokens.weight")
    if name not in tensors:
        raise ConvertError(f"the checkpoint has no {name}")
    return int(tensors[name].shape[0])


def _ensure_tokens(tokenizer, tokens, rows: int) -> list[int]:
    """Add the tokens the original code adds at run time (in order, only the missing ones); their
    ids must exist in the embedding."""
    vocab = tokenizer.get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        tokenizer.add_tokens(missing)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    if max(ids) >= rows:
        raise ConvertError(f"token ids {dict(zip(tokens, ids))} do not fit the checkpoint's {rows} embedding rows "
                           "(is --base the tokenizer this checkpoint was trained with?)")
    return ids


# -- per family ------------------------------------------------------------------------------------------
def _coconut(config, tensors, tokenizer, opts):
    kind = _base_kind(config)
    tensors = _strip_wrapper(tensors)
    rows = _embedding_rows(tensors, kind)
    start, end, latent = _ensure_tokens(tokenizer, LATENT_TOKENS, rows)
    spec = LatentSpec(kind="feedback", default_budget=opts.latent_budget or 6, max_budget=opts.max_budget or 64,
                      start_token_ids=(start,), end_token_ids=(end,), latent_token_id=latent)
    return kind, rows, tensors, {"latent_spec": spec.to_config()}


def _codi(config, tensors, tokenizer, opts):
    kind = _base_kind(config)
    kept = {k: v for k, v in tensors.items() if k.startswith(CODI_PREFIX) or k.startswith("prj.")}
    if not any(k.startswith(CODI_PREFIX) for k in kept):
        raise ConvertError(f"no {CODI_PREFIX}* tensors: not a CODI checkpoint (torch.save of the CODI module)")
    if "prj.1.weight" not in kept:
        raise ConvertError("no prj.1.weight: CODI checkpoints without the projection head (use_prj=False) "
                           "are not supported")
    rows = _embedding_rows(kept, kind, CODI_PREFIX)
    V = rows - 3  # CODI appends pad, bot, eot after the base vocabulary
    if len(tokenizer) != V:
        raise ConvertError(f"the tokenizer has {len(tokenizer)} tokens, the checkpoint's embedding {rows} rows: "
                           f"CODI's base vocabulary must be rows - 3 = {V} (is --base the base model's tokenizer?)")
    pad, bot, eot = _ensure_tokens(tokenizer, CODI_TOKENS, rows)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = CODI_TOKENS[0]
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    lora_a = sorted(k for k in kept if ".lora_A." in k)
    if not lora_a:
        raise ConvertError("no LoRA tensors (…lora_A.default.weight): not a CODI checkpoint")
    present = {k.split(".lora_A.")[0].rsplit(".", 1)[-1] for k in lora_a}
    codi = {
        "lora_r": int(kept[lora_a[0]].shape[0]),
        "lora_alpha": opts.lora_alpha,
        "lora_dropout": 0.1,
        "lora_target_modules": [m for m in LORA_TARGETS[kind] if m in present],
        "lora_fan_in_fan_out": kind == "gpt2",
        "use_prj": True,
        "prj_dim": int(kept["prj.1.weight"].shape[0]),
        "prj_dropout": 0.0,
        "prj_no_ln": "prj.ln.weight" not in kept,
        "remove_eos": not opts.keep_eos,
        "pad_token_id": pad,
        "bot_token_id": bot,
        "eot_token_id": eot,
        "weights_prefix": CODI_PREFIX,
    }
    spec = LatentSpec(kind="feedback", default_budget=opts.latent_budget or 6, max_budget=opts.max_budget or 64,
                      start_token_ids=(bot,) if codi["remove_eos"] else (eos, bot),
                      end_token_ids=(eot,) if codi["remove_eos"] else (eot, eos),
                      latent_token_id=None, suppress_token_ids=(eot,))
    return kind, rows, kept, {"latent_spec": spec.to_config(), "codi": codi}


def _lotus(config, tensors, tokenizer, opts):
    kind = _base_kind(config)
    tensors = _strip_wrapper(tensors)
    rows = _embedding_rows(tensors, kind)
    start, end, latent = _ensure_tokens(tokenizer, LATENT_TOKENS, rows)
    spec = LatentSpec(kind="looped", default_budget=opts.latent_budget or 6, max_budget=opts.max_budget or 16,
                      c_thought=opts.c_thought or (25 if kind == "llama" else 13),
                      start_token_ids=(start,), end_token_ids=(end,), latent_token_id=latent)
    return kind, rows, tensors, {"latent_spec": spec.to_config(), "lotus": {"latent_injection_mode": opts.injection}}


CONVERTERS = {"coconut": _coconut, "codi": _codi, "lotus": _lotus}


# -- writing ---------------------------------------------------------------------------------------------
def _unaliased(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors stores no aliases: a tensor sharing storage with an earlier one is copied."""
    seen: set[int] = set()
    out = {}
    for name, t in sorted(tensors.items()):
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone().contiguous() if ptr in seen else t.contiguous()
        seen.add(ptr)
    return out


def convert(family: str, src, dst, *, base=None, latent_budget: int | None = None, max_budget: int | None = None,
            c_thought: int | None = None, lora_alpha: float = 32, keep_eos: bool = False,
            injection: str = "add") -> Path:
    """Write the servable folder ``dst`` from a released checkpoint ``src``; returns ``dst``."""
    from transformers import AutoTokenizer

    if family not in CONVERTERS:
        raise ConvertError(f"--family {family!r} is unknown; allowed: {', '.join(FAMILIES)}")
    if injection not in ("add", "replace"):
        raise ConvertError(f"--injection {injection!r}: allowed values: add, replace")
    src, dst = Path(src), Path(dst)
    meta = Path(base) if base is not None else (src if src.is_dir() else src.parent)
    if not (meta / "config.json").is_file():
        raise ConvertError(f"{meta} has no config.json: pass the base model's folder with --base")
    if dst.resolve() in (src.resolve(), meta.resolve()):
        raise ConvertError("DST must be a new folder, not SRC or --base")
    config = json.loads((meta / "config.json").read_text())
    if "latent_spec" in config:
        raise ConvertError(f"{meta}/config.json already has a latent_spec: nothing to convert")
    tokenizer = AutoTokenizer.from_pretrained(str(meta))
    opts = argparse.Namespace(latent_budget=latent_budget, max_budget=max_budget, c_thought=c_thought,
                              lora_alpha=lora_alpha, keep_eos=keep_eos, injection=injection)
    kind, rows, tensors, extra = CONVERTERS[family](config, load_tensors(weight_files(src)), tokenizer, opts)
    tied = config.get("tie_word_embeddings", True)
    if tied and family != "codi":  # one copy of a tied head (the vLLM model ties it to the embedding)
        tensors.pop("lm_head.weight", None)

    out_config = {**config, "architectures": [ARCHITECTURES[family, kind]], "vocab_size": rows, **extra}
    dst.mkdir(parents=False, exist_ok=True)
    from safetensors.torch import save_file

    save_file(_unaliased(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(out_config, indent=2) + "\n")
    tokenizer.save_pretrained(str(dst))
    if (meta / "generation_config.json").is_file():
        shutil.copyfile(meta / "generation_config.json", dst / "generation_config.json")
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = OneLineArgumentParser(prog="python -m vllm_loop.convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", required=True, choices=FAMILIES)
    ap.add_argument("src", help="released checkpoint: a folder, or one weights file (then give --base)")
    ap.add_argument("dst", help="folder to write (its parent must exist)")
    ap.add_argument("--base", help="folder with the base model's config.json and tokenizer (default: SRC)")
    ap.add_argument("--latent-budget", type=int, help="trained default latent_budget (default 6)")
    ap.add_argument("--max-budget", type=int, help="largest latent_budget a request may ask for")
    ap.add_argument("--c-thought", type=int, help="LOTUS: latent positions per loop (default 25 Llama, 13 GPT-2)")
    ap.add_argument("--lora-alpha", type=float, default=32, help="CODI: LoRA alpha of the run (default 32)")
    ap.add_argument("--keep-eos", action="store_true", help="CODI: the run kept EOS around bot/eot (remove_eos off)")
    ap.add_argument("--injection", default="add", choices=("add", "replace"), help="LOTUS latent injection mode")
    args = ap.parse_args(argv)
    try:
        out = convert(args.family, args.src, args.dst, base=args.base, latent_budget=args.latent_budget,
                      max_budget=args.max_budget, c_thought=args.c_thought, lora_alpha=args.lora_alpha,
                      keep_eos=args.keep_eos, injection=args.injection)
    except (ConvertError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = json.loads((out / "config.json").read_text())
    print(f"wrote {out} ({cfg['architectures'][0]}, latent_spec {json.dumps(cfg['latent_spec'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
