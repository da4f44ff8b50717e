"""Oracles and baselines of the DDTree algorithms; never shipped into vLLM."""
