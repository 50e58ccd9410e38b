"""The argument parser of the plugin's command-line tools (``vllm_loop.convert``, ``vllm_loop.tune``,
``vllm_loop.testing.checkpoints``)."""

from __future__ import annotations

import argparse
import sys


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2 (no usage dump, no traceback),
    so a script that calls the tool shows the bad flag and nothing else."""

    def error(self, message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)
