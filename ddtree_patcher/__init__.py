"""ddtree-patch: versioned libcst transforms that add DDTree to an installed vLLM.

Layout: ``cli`` (click commands) -> ``engine`` (plan + transactional writes) over a
``target`` (the vLLM install found through its dist-info).  Transforms live in
``ddtree_patcher.patches`` (source folder ``patches/``), the smoke suite in
``ddtree_patcher.verify`` (``verify/``); the DDTree algorithms are part of the payload
added to vLLM (``patches/ddtree/payload/core``; docs/DESIGN.md, "Layout").
Importing this package pulls in nothing heavy (no click, libcst or torch).
"""

__version__ = "0.1.0"
JSON_SCHEMA = "ddtree-patch/1"
