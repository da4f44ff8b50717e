"""What every DDTree hook shares: the added package, the guards, and ``hook``
(framework.hook with that package), so each hook is declared by what it runs."""

from __future__ import annotations

import functools

from ..framework import hook as _hook

PKG = "vllm.v1.spec_decode.ddtree"

# the runner built its DDTree runtime (the hooks of the runner's step)
RUNTIME = "getattr(self, 'ddtree', None) is not None"
# attention metadata the runtime marked for tree attention
MARKED = "getattr(attn_metadata, 'ddtree', None) is not None"


def on(spec: str, lookup: str = "") -> str:
    """The guard of a hook that runs when ``spec`` (code of a SpeculativeConfig, or of
    None; ``lookup``: code that gives None where even the attribute may be missing)
    runs DDTree: SpeculativeConfig.use_ddtree(), which SPEC_EDIT adds."""
    return f"{lookup or spec} is not None and {spec}.use_ddtree()"


hook = functools.partial(_hook, package=PKG)
