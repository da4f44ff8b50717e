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

# In a checkout (not installed), patches/ and verify/ sit beside this package, not in it
# (pyproject's package-dir maps them in at install time): map them the same way here.
import os as _os

_root = _os.path.dirname(_os.path.dirname(__file__))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "patches")) and \
        _os.path.isfile(_os.path.join(_root, "patches", "__init__.py")):
    __path__.append(_root)  # noqa: F821  (a package's own __path__)
del _os, _root
