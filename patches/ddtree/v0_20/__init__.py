"""DDTree transforms for vLLM 0.20.0-0.20.2 (V1 runner, CUDA tree attention)."""
