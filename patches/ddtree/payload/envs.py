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


# the tree-attention launch table's keys (attention/triton_tree.py): ints >= 1, or yes/no
TUNING_INTS = ("max_rows", "block_q", "block_n", "splits", "num_warps", "num_stages",
               "maxnreg", "combine_warps", "combine_rows")
# Triton tile / warp counts
TUNING_POW2 = ("block_n", "num_warps", "combine_warps", "combine_rows")
TUNING_FLAGS = ("two_loops", "fused_combine")


def attn_tuning_table(path: str) -> list[dict]:
    """The launch table in ``path`` (VLLM_DDTREE_ATTN_TUNING), checked: a JSON list of
    objects, each with max_rows and only the known keys, block_n a power of two >= 16;
    else ValueError naming the variable, the file and the entry."""
    import json

    where = f"{ATTN_TUNING}={path}"
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot read a JSON launch table ({e})") from e
    if not isinstance(table, list) or not table:
        raise ValueError(f"{where}: the launch table must be a non-empty JSON list")
    for i, t in enumerate(table):
        bad = None
        if not isinstance(t, dict) or "max_rows" not in t:
            bad = "must be an object with max_rows"
        else:
            extra = set(t) - set(TUNING_INTS) - set(TUNING_FLAGS)
            if extra:
                bad = f"has unknown keys {sorted(extra)} (known: " \
                      f"{', '.join(TUNING_INTS + TUNING_FLAGS)})"
            for k in TUNING_INTS:
                v = t.get(k)
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                    bad = f"{k} must be an integer >= 1, got {v!r}"
                elif k in TUNING_POW2 and v is not None and v & (v - 1):
                    bad = f"{k} must be a power of two, got {v}"
            if isinstance(t.get("block_n"), int) and t["block_n"] < 16:
                bad = f"block_n must be >= 16 (a Triton dot), got {t['block_n']}"
            for k in TUNING_FLAGS:
                if k in t and not isinstance(t[k], bool):
                    bad = f"{k} must be true or false, got {t[k]!r}"
        if bad:
            raise ValueError(f"{where}: entry {i} {bad}")
    return table
