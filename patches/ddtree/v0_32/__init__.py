"""DDTree transforms for vLLM 0.32.0 and 0.33.0: ``v1_runner`` (V1 model runner, CPU
and CUDA attention), ``v2_runner`` (the V2 model runner), ``gdn`` (GDN hybrids, CPU),
``gdn_cuda`` (GDN hybrids, CUDA)."""
