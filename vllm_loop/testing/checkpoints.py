"""Tiny random checkpoints with the real config keys and state-dict names of each family.

One factory serves the tests, the examples and the demo. A checkpoint folder holds what a real
Hugging Face repository holds: ``config.json`` (the family's real keys), ``model.safetensors`` (the
real tensor names), a BPE tokenizer trained offline on ``corpus.txt`` with the family's special
tokens, and ``generation_config.json`` where the real model ships one. Same seed, same bytes.

    python -m vllm_loop.testing.checkpoints --family ouro --out /tmp/tiny-ouro
    python -m vllm_loop.testing.checkpoints --family huginn_raven --option layout=llama --out DIR

    from vllm_loop.testing.checkpoints import make_checkpoint
    path = make_checkpoint("ouro", "/tmp/tiny-ouro", seed=0, total_ut_steps=4)

Each family lives in ``vllm_loop/testing/families/<name>.py`` and registers itself with
``@family(...)``; this module only knows how to write what a family builds.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_loop.cli import OneLineArgumentParser

CORPUS = Path(__file__).with_name("corpus.txt")


@dataclass
class TokenizerSpec:
    """The tokens a family's tokenizer must have, in id order before the learned BPE merges.

    ``special`` tokens take ids 0..len(special)-1 (as in Ouro's tokenizer). ``appended`` tokens are
    added after the learned vocabulary, the way COCONUT and LOTUS call ``tokenizer.add_tokens``.
    """

    special: list[str]
    bos: str | None = None
    eos: str | None = None
    pad: str | None = None
    unk: str | None = None
    appended: list[str] = field(default_factory=list)
    chat_template: str | None = None
    add_bos: bool = False  # prepend bos when encoding (Llama-3 style tokenizers do)


@dataclass
class Checkpoint:
    """What a family builder returns: everything that goes into the folder."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    generation_config: dict[str, Any] | None = None
    files: dict[str, str] = field(default_factory=dict)  # extra text files, e.g. remote-code modules
    # Where the tensors go: ``*.safetensors``, else a ``torch.save`` state dict under that name (the
    # original COCONUT / CODI / LOTUS training checkpoints: ``checkpoint_6``, ``pytorch_model.bin``).
    weights_file: str = "model.safetensors"
    # Appended tokens left out of the saved tokenizer (the base model's tokenizer, to which the
    # original training code adds them at run time); their ids stay the ones the weights were shaped for.
    tokenizer_without: tuple[str, ...] = ()


@dataclass
class Family:
    name: str
    doc: str
    tokenizer: Callable[[dict[str, str]], TokenizerSpec]
    build: Callable[["BuildContext"], Checkpoint]
    options: dict[str, tuple[str, ...]]  # option name -> allowed values ("" = free-form)
    defaults: dict[str, str]


@dataclass
class BuildContext:
    """Handed to a family builder: seeded RNG, token ids, chosen options and config overrides."""

    seed: int
    options: dict[str, str]
    overrides: dict[str, Any]
    vocab_size: int
    token_ids: dict[str, int]
    generator: torch.Generator
    meta: bool = False  # config only: tensors are shapes without data (full-size configs for benchmarks)

    def randn(self, *shape: int, std: float = 0.02) -> torch.Tensor:
        if self.meta:
            return torch.empty(*shape, device="meta")
        return torch.randn(*shape, generator=self.generator, dtype=torch.float32) * std

    def norm_weight(self, n: int, jitter: float = 0.1) -> torch.Tensor:
        """RMSNorm/LayerNorm gains near 1 (random, so a wrong norm placement shows in tests)."""
        return 1.0 + self.randn(n, std=jitter)

    def float_option(self, name: str, minimum: float = 0.0) -> float:
        """A numeric family option (options are strings on the command line)."""
        text = self.options[name]
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not value >= minimum:
            raise CheckpointError(f"--option {name}={text}: expected a number >= {minimum:g}")
        return value

    def config(self, base: dict[str, Any]) -> dict[str, Any]:
        """Apply user overrides on top of a family's base config (unknown keys are allowed:
        real checkpoints carry keys we do not read)."""
        cfg = dict(base)
        cfg.update(self.overrides)
        return cfg


FAMILY_MODULES = ("llama", "ouro", "huginn_raven", "coconut", "codi", "lotus")
FAMILIES: dict[str, Family] = {}


def family(name: str, *, doc: str, tokenizer, options=None, defaults=None):
    """Decorator registering a builder ``fn(ctx) -> Checkpoint`` as a family."""

    def wrap(build):
        FAMILIES[name] = Family(name, doc, tokenizer, build, dict(options or {}), dict(defaults or {}))
        return build

    return wrap


def _load_families() -> None:
    for mod in FAMILY_MODULES:
        try:
            importlib.import_module(f"vllm_loop.testing.families.{mod}")
        except ModuleNotFoundError as e:  # a family module not written yet
            if e.name != f"vllm_loop.testing.families.{mod}":
                raise


class CheckpointError(ValueError):
    """Bad factory input; the message names the field and the allowed values."""


def train_tokenizer(spec: TokenizerSpec, vocab_size: int, texts=None):
    """Byte-level BPE trained on ``texts`` (an iterable of strings; default: the lines of the shipped
    corpus); deterministic for a given spec, size and text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    learned = vocab_size - len(spec.appended)
    trainer = trainers.BpeTrainer(
        vocab_size=learned,
        special_tokens=list(spec.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.read_text().splitlines() if texts is None else texts, trainer=trainer)
    if spec.appended:
        tok.add_tokens(list(spec.appended))
    if spec.add_bos and spec.bos:
        from tokenizers import processors

        bos_id = tok.token_to_id(spec.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A", pair=f"{spec.bos} $A {spec.bos} $B", special_tokens=[(spec.bos, bos_id)]
        )
    return tok


def _write_tokenizer(out: Path, spec: TokenizerSpec, tok) -> None:
    tok.save(str(out / "tokenizer.json"))
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    special_map: dict[str, Any] = {}
    for key, val in (("bos_token", spec.bos), ("eos_token", spec.eos), ("pad_token", spec.pad), ("unk_token", spec.unk)):
        if val is not None:
            cfg[key] = val
            special_map[key] = val
    extra = [t for t in spec.special if t not in special_map.values()]
    if extra:
        cfg["additional_special_tokens"] = extra
        special_map["additional_special_tokens"] = extra
    if spec.chat_template:
        cfg["chat_template"] = spec.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def _dtype_of(config: dict[str, Any]) -> torch.dtype:
    name = config.get("torch_dtype") or config.get("dtype") or "float32"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _check_options(fam: Family, options: dict[str, str]) -> dict[str, str]:
    chosen = dict(fam.defaults)
    for key, val in options.items():
        if key not in fam.options:
            allowed = ", ".join(sorted(fam.options)) or "(none)"
            raise CheckpointError(f"--option {key}: family '{fam.name}' has no such option; allowed: {allowed}")
        values = fam.options[key]
        if values and val not in values:
            raise CheckpointError(f"--option {key}={val}: allowed values for family '{fam.name}': {', '.join(values)}")
        chosen[key] = val
    return chosen


def make_checkpoint(
    family_name: str,
    out: str | Path,
    *,
    seed: int = 0,
    options: dict[str, str] | None = None,
    tokenizer_vocab: int = 512,
    weights: bool = True,
    **overrides: Any,
) -> Path:
    """Write a tiny random checkpoint of ``family_name`` into ``out`` and return the path.

    ``options`` picks a family variant (e.g. ``{"layout": "olmo2"}``); ``overrides`` replace
    config.json values (e.g. ``total_ut_steps=2``) before the weights are shaped from it.
    ``weights=False`` writes everything but model.safetensors: a full-size config to serve with
    random weights (``load_format="dummy"``) in benchmarks.
    """
    out = Path(out)
    if not out.parent.is_dir():
        raise CheckpointError(f"--out {out}: the parent folder {out.parent} does not exist")
    ckpt, spec, tok = plan_checkpoint(family_name, seed=seed, options=options, tokenizer_vocab=tokenizer_vocab,
                                      weights=weights, **overrides)
    write_checkpoint(out, ckpt, spec, tok, weights=weights)
    return out


def plan_checkpoint(
    family_name: str,
    *,
    seed: int = 0,
    options: dict[str, str] | None = None,
    tokenizer_vocab: int = 512,
    weights: bool = True,
    texts=None,
    tokenizer=None,
    **overrides: Any,
) -> tuple[Checkpoint, TokenizerSpec, Any]:
    """What ``make_checkpoint`` writes, in memory: ``(checkpoint, tokenizer spec, tokenizer)``.

    ``texts`` trains the tokenizer on other text than the shipped corpus (the trained models of
    ``vllm_loop.training`` pass their corpus), ``tokenizer`` reuses one trained before for the
    same family; ``weights=False`` gives meta tensors (names and shapes only), for a caller that
    brings its own weights.
    """
    _load_families()
    if family_name not in FAMILIES:
        raise CheckpointError(f"--family {family_name!r} is unknown; allowed: {', '.join(sorted(FAMILIES))}")
    fam = FAMILIES[family_name]
    chosen = _check_options(fam, {k: str(v) for k, v in (options or {}).items()})

    spec = fam.tokenizer(chosen)
    tok = tokenizer if tokenizer is not None else train_tokenizer(spec, tokenizer_vocab, texts)
    token_ids = {t: tok.token_to_id(t) for t in [*spec.special, *spec.appended]}
    ctx = BuildContext(
        seed=seed,
        options=chosen,
        overrides=dict(overrides),
        vocab_size=tok.get_vocab_size(),
        token_ids=token_ids,
        generator=torch.Generator().manual_seed(seed),
        meta=not weights,
    )
    return fam.build(ctx), spec, tok


def write_checkpoint(out: Path, ckpt: Checkpoint, spec: TokenizerSpec, tok, *, weights: bool = True) -> Path:
    """Write a checkpoint folder: model.safetensors (tensors cast to the config's ``torch_dtype``),
    config.json, generation_config.json, extra files, and the tokenizer files."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(exist_ok=True)
    dtype = _dtype_of(ckpt.config)
    if weights:
        tensors = {k: v.detach().to(dtype).contiguous() for k, v in sorted(ckpt.tensors.items())}
        if ckpt.weights_file.endswith(".safetensors"):
            save_file(tensors, str(out / ckpt.weights_file), metadata={"format": "pt"})
        else:
            torch.save(tensors, str(out / ckpt.weights_file))
    if ckpt.tokenizer_without:
        # the same learned vocabulary (same size, same corpus) without the appended tokens
        kept = [t for t in spec.appended if t not in ckpt.tokenizer_without]
        drop_spec = TokenizerSpec(**{**spec.__dict__, "appended": kept})
        for attr in ("bos", "eos", "pad", "unk"):
            if getattr(drop_spec, attr) in ckpt.tokenizer_without:
                setattr(drop_spec, attr, None)
        spec, tok = drop_spec, train_tokenizer(drop_spec, tok.get_vocab_size() - len(ckpt.tokenizer_without))
    (out / "config.json").write_text(json.dumps(ckpt.config, indent=2) + "\n")
    if ckpt.generation_config is not None:
        (out / "generation_config.json").write_text(json.dumps(ckpt.generation_config, indent=2) + "\n")
    for name, text in sorted(ckpt.files.items()):
        (out / name).write_text(text)
    _write_tokenizer(out, spec, tok)
    return out


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> int:
    _load_families()
    parser = OneLineArgumentParser(
        prog="python -m vllm_loop.testing.checkpoints",
        description="Write a tiny random checkpoint with a family's real config keys and tensor names.",
    )
    parser.add_argument("--family", help=f"one of: {', '.join(sorted(FAMILIES))}")
    parser.add_argument("--out", help="output folder (created; its parent must exist)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-vocab", type=int, default=512,
                        help="BPE vocabulary size (config vocab_size follows it unless --set vocab_size=N)")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE", help="family variant")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config.json override")
    args = parser.parse_args(argv)

    def pairs(items: list[str], flag: str) -> dict[str, str]:
        result = {}
        for item in items:
            if "=" not in item:
                raise CheckpointError(f"{flag} {item!r}: expected NAME=VALUE")
            k, v = item.split("=", 1)
            result[k] = v
        return result

    try:
        if not args.family:
            raise CheckpointError(f"--family is required; allowed: {', '.join(sorted(FAMILIES))}")
        if not args.out:
            raise CheckpointError("--out is required: the folder to write the checkpoint into")
        options = pairs(args.option, "--option")
        overrides = {k: _parse_value(v) for k, v in pairs(args.set, "--set").items()}
        path = make_checkpoint(
            args.family, args.out, seed=args.seed, options=options, tokenizer_vocab=args.tokenizer_vocab, **overrides
        )
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = json.loads((path / "config.json").read_text())
    print(f"wrote {path} ({args.family}, {cfg.get('architectures', ['?'])[0]}, seed {args.seed})")
    return 0


if __name__ == "__main__":
    # Run the importable module's main, not __main__'s copy: families register into that one.
    from vllm_loop.testing.checkpoints import main as _main

    sys.exit(_main())
