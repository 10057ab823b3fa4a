"""Serving mmspec's draft heads with vLLM (docs/vllm.md).

* :func:`export_head` (:mod:`.export`): an mmspec EAGLE-style head -> a folder vLLM's EAGLE path loads;
* :mod:`.plugin`: the ``vllm.general_plugins`` entry point registering the exported architecture;
* :func:`speculative_config` / ``python -m mmspec.integrations.vllm`` (:mod:`.launch`): checks a target and
  an exported head against each other before vLLM starts, then builds the speculative config or runs
  ``vllm serve``.

Importing this package imports neither vLLM nor torch; only :mod:`.model` (loaded by vLLM) needs vLLM.
"""

from __future__ import annotations

from .checkpoints import CheckpointError, read_exported, read_head, read_target
from .export import ExportOptions, export_head
from .launch import check_pair, speculative_config

__all__ = ["CheckpointError", "ExportOptions", "check_pair", "export_head", "read_exported", "read_head",
           "read_target", "speculative_config"]
