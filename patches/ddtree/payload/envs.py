"""Every environment variable DDTree reads, in one place, with one parser.

Only diagnostics are variables (they change no output): ``VLLM_DDTREE_STATS_FILE``
(walk statistics, stats.py) and ``VLLM_DDTREE_ATTN_TUNING`` (the tree kernel's launch
table, attention/triton_tree.py).  Behaviour is set by ``speculative_config`` keys
(settings.py, docs/configuration.md); the variables that set it before keep working
for one release, each with one deprecation warning (DEPRECATED: what they map to).
"""

from __future__ import annotations

import os

from . import log

STATS_FILE = "VLLM_DDTREE_STATS_FILE"
ATTN_TUNING = "VLLM_DDTREE_ATTN_TUNING"

# deprecated name -> what replaces it (read at engine configuration only)
DEPRECATED = {
    "VLLM_DDTREE_V2": "VLLM_USE_V2_MODEL_RUNNER",
    "VLLM_DDTREE_ASYNC": "async_scheduling",
    "VLLM_DDTREE_SPLIT_ATTN": "ddtree_split_attn",
    "VLLM_DDTREE_BUILD_GRAPHS": "ddtree_build_graphs",
    "VLLM_DDTREE_CHAIN_GRAPHS": "ddtree_chain_graphs",
    "VLLM_DDTREE_ARMS": "ddtree_arms",
    "VLLM_DDTREE_COST_TABLE": "ddtree_cost_table",
}

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
_warned: set[str] = set()  # deprecated names already warned about (once per process)


def read(name: str) -> str | None:
    """The variable's value, stripped; None when it is unset or empty."""
    value = os.environ.get(name, "").strip()
    return value or None


def flag(value, what: str) -> bool:
    """A yes/no setting: 1/true/yes/on or 0/false/no/off (any case), else ValueError
    naming ``what``."""
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    raise ValueError(f"{what} must be one of {'/'.join(TRUE)} or {'/'.join(FALSE)}, "
                     f"got {value!r}")


def deprecated(name: str) -> str | None:
    """A deprecated variable's value (read()), with one warning per process naming what
    replaces it."""
    value = read(name)
    if value is not None and name not in _warned:
        _warned.add(name)
        log(__name__, "%s is deprecated and goes away in the next release: use %s "
            "(docs/configuration.md)", name, DEPRECATED[name], warn=True)
    return value


def stats_file() -> str | None:
    return read(STATS_FILE)


def attn_tuning() -> str | None:
    return read(ATTN_TUNING)
