"""Structured outputs with trees (V1 runner), vLLM 0.32.0 and 0.33.0: two hooks of
``StructuredOutputManager`` (vllm/v1/structured_output/__init__.py) that hand a DDTree
engine's requests to payload v1/grammar.py:

* ``validate_tokens``: the drafts the grammar forbids are cut along the tree (the
  longest prefix of the pop order whose every node the grammar takes after its path),
  not as a chain.
* ``grammar_bitmask``: every tree node's row is the grammar's mask after that node's
  own path (vLLM fills the root rows; the hook fills the node rows depth first).

Without DDTree the stock code runs unchanged.
"""

from __future__ import annotations

from ...framework import file_edit
from ..hooks import hook, on

STRUCTURED = "vllm/v1/structured_output/__init__.py"
ON = on("self.vllm_config.speculative_config")

STRUCTURED_EDIT = file_edit(STRUCTURED, [
    hook("StructuredOutputManager.validate_tokens",
         "return validate(self, request, spec_tokens)\n", guard=ON,
         imports=("v1.grammar", "validate"),
         marker="return validate(self, request, spec_tokens)"),
    hook("StructuredOutputManager.grammar_bitmask",
         "return bitmask(self, requests, structured_output_request_ids,\n"
         "               scheduled_spec_decode_tokens)\n",
         guard=f"{ON} and not getattr(self, '_ddtree_inner', False)",
         imports=("v1.grammar", "bitmask"),
         marker="return bitmask(self, requests, structured_output_request_ids,"),
], "structured outputs: grammar masks per tree node, forbidden drafts cut along the tree")
