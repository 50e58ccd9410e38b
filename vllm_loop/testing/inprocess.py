"""A plugin model built in this process with vLLM's own config and constructors, without an engine.

For checks of what happens at load time (missing tensors) and of what a model allocates, where an
engine start (about a minute on CPU) would add nothing. It initialises a one-process ``gloo``
group the first time, which stays for the life of the process: call it from a subprocess of a
test, never from a process that starts engines afterwards.

    from vllm_loop.testing.inprocess import build_model, checkpoint_tensors
    model = build_model("/tmp/tiny-ouro")                    # constructed, weights not loaded
    model.load_weights(checkpoint_tensors("/tmp/tiny-ouro").items())
"""

from __future__ import annotations

import socket
from pathlib import Path

_initialised = False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_config(path: str, **engine_args):
    """vLLM's ``VllmConfig`` for ``path`` with test defaults (fp32, eager, small context)."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_loop import plugin

    plugin.register()
    args = dict(model=str(path), dtype="float32", max_model_len=512, enforce_eager=True, gpu_memory_utilization=0.1)
    args.update(engine_args)
    return EngineArgs(**args).create_engine_config()


def build_model(path: str, **engine_args):
    """The model class vLLM would pick for ``path``, constructed on CPU (weights not loaded)."""
    global _initialised
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = engine_config(path, **engine_args)
    with set_current_vllm_config(config):
        if not _initialised:
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
            ensure_model_parallel_initialized(1, 1)
            _initialised = True
        with set_default_torch_dtype(config.model_config.dtype):
            model = initialize_model(vllm_config=config)
    model.vllm_config = config
    return model


def checkpoint_tensors(path: str) -> dict:
    """Every tensor of a checkpoint folder (safetensors files, else ``*.bin`` / ``*.pt``)."""
    import torch
    from safetensors.torch import load_file

    folder = Path(path)
    out: dict = {}
    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        out.update(load_file(str(f)))
    if not files:
        for f in sorted([*folder.glob("*.bin"), *folder.glob("*.pt")]):
            out.update(torch.load(str(f), map_location="cpu", weights_only=True))
    return out
