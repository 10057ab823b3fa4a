"""Bridges from mmspec to other inference engines (``mmspec.integrations.vllm``: serving mmspec's draft heads
with vLLM). Importing this package imports no engine."""
