"""DDTreeConfig: DDTree's settings, parsed and validated once per engine from its
``speculative_config`` (config.py's VllmConfig hook stores it there as
``ddtree_config``) and handed from there to the drafter, the runtimes, the attention
state and the scheduler.  Every key and variable: docs/configuration.md.

A key that does not apply to the engine's runner is refused, with what to do; a
deprecated environment variable (envs.py) fills its key where the key is unset and
the key applies, and is ignored (with its warning) where it does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import envs
from .sched.channel import ArmChannel

SPLIT_MODES = ("auto", "on", "off")
V2_ONLY = "vLLM's V2 model runner (the CUDA default of 0.32/0.33); this engine uses V1"


@dataclass(frozen=True)
class DDTreeConfig:
    budget: int  # B: draft nodes verified per step (num_speculative_tokens)
    depth: int  # L: drafter positions per step (ddtree_depth)
    v2: bool = False  # the engine runs vLLM's V2 model runner
    budget_control: str = "off"  # "auto": DDTree chooses the verify size by tokens/s
    budgets: tuple[int, ...] | None = None  # V1, "auto": the budgets it chooses from
    cost_table: str | None = None  # V1, "auto": step-cost table (JSON), one for all ranks
    chain_budget: int = 0  # V2: steps of <= C drafts per request run as the chain
    arms: tuple[int, int] | None = None  # V2, "auto": a pinned (window, explore)
    split_attn: str = "auto"  # CUDA: split tree attention ("auto" / "on" / "off")
    build_graphs: bool = True  # V2: the tree build replays its own CUDA graphs
    chain_graphs: bool = True  # V2: the chain arm drafts from its own draft graphs
    synthetic: str | None = None  # testing aid: a synthetic drafter profile (JSON)
    # the one mutable member: the tree-vs-chain choice's worker -> scheduler channel
    channel: ArmChannel = field(default_factory=ArmChannel, compare=False, repr=False)


def enabled(spec) -> bool:
    """Does this speculative config (or None) run DDTree?"""
    return getattr(spec, "ddtree_budget", None) is not None


def of(spec) -> DDTreeConfig:
    """The engine's DDTreeConfig (set at engine configuration)."""
    cfg = getattr(spec, "ddtree_config", None)
    if cfg is None:
        raise RuntimeError("method='ddtree': the speculative config has no ddtree_config "
                           "(it is set when vLLM builds the engine's VllmConfig)")
    return cfg


def build(spec, v2: bool, tensor_parallel: int = 1) -> DDTreeConfig:
    """The DDTreeConfig of a validated speculative config (ddtree_post_init) whose V2
    defaults are resolved (config.default_batch_policy)."""
    control = getattr(spec, "ddtree_budget_control", None) or "off"
    chain = getattr(spec, "ddtree_chain_budget", None)
    budgets = getattr(spec, "ddtree_budgets", None)
    if v2 and budgets is not None:
        raise ValueError("ddtree_budgets is the V1 runner's list of tree budgets; on the "
                         "V2 runner ddtree_budget_control='auto' chooses between the tree "
                         "and the chain per batch size: drop ddtree_budgets")
    if not v2 and chain:
        raise ValueError(f"ddtree_chain_budget runs on {V2_ONLY}: drop the knob")
    if envs.attn_tuning() is not None:  # a bad launch table fails here, not mid-forward
        envs.attn_tuning_table(envs.attn_tuning())
    if not v2 and control == "auto" and \
            getattr(spec, "num_speculative_tokens_per_batch_size", None):
        raise ValueError("ddtree_budget_control='auto' and num_speculative_tokens_per_"
                         "batch_size both choose the tree budget on the V1 runner: use "
                         "one of them")
    return DDTreeConfig(
        budget=spec.ddtree_budget, depth=spec.ddtree_depth, v2=v2, budget_control=control,
        budgets=None if budgets is None else tuple(budgets),
        cost_table=_cost_table(spec, v2, control, tensor_parallel),
        chain_budget=(chain or 0) if v2 else 0, arms=_arms(spec, v2, control),
        split_attn=_split_attn(spec), build_graphs=_v2_flag(spec, "ddtree_build_graphs", v2),
        chain_graphs=_v2_flag(spec, "ddtree_chain_graphs", v2),
        synthetic=getattr(spec, "ddtree_synthetic", None))


def _old(key: str) -> tuple[str, str | None]:
    """(name, value or None) of the deprecated variable that set ``key``."""
    name = next(n for n, k in envs.DEPRECATED.items() if k == key)
    return name, envs.deprecated(name)


def _split_attn(spec) -> str:
    key = "ddtree_split_attn"
    value = getattr(spec, key, None)
    name, old = _old(key)
    if value is not None:
        return parse_split(value, key)
    if old is None or old.lower() == "auto":
        return "auto"
    return "on" if envs.flag(old, name) else "off"


def parse_split(value, what: str) -> str:
    mode = str(value).strip().lower()
    if mode not in SPLIT_MODES:
        raise ValueError(f"{what} must be one of {', '.join(SPLIT_MODES)}, got {value!r}")
    return mode


def _v2_flag(spec, key: str, v2: bool) -> bool:
    """A V2 switch that is on by default (ddtree_build_graphs, ddtree_chain_graphs)."""
    value = getattr(spec, key, None)
    name, old = _old(key)
    if value is not None:
        if not v2:
            raise ValueError(f"{key} applies to {V2_ONLY}: drop it")
        return envs.flag(value, key)
    return True if old is None or not v2 else envs.flag(old, name)


def _arms(spec, v2: bool, control: str) -> tuple[int, int] | None:
    key = "ddtree_arms"
    value = getattr(spec, key, None)
    applies = v2 and control == "auto"
    name, old = _old(key)
    if value is not None:
        if not applies:
            raise ValueError(f"{key} pins the tree-vs-chain choice of "
                             "ddtree_budget_control='auto' on the V2 runner, which this "
                             "engine does not run: drop it")
        return parse_arms(value, key)
    return parse_arms(old, name) if old is not None and applies else None


def parse_arms(value, what: str) -> tuple[int, int]:
    """(window, explore) from [window, explore] or "window,explore"; ValueError naming
    ``what`` for anything else."""
    parts = value.split(",") if isinstance(value, str) else value
    try:
        w, e = (int(x) for x in parts)
        if any(isinstance(x, (bool, float)) for x in parts):
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be [window, explore] (two integers; as a variable "
                         f"'window,explore'), got {value!r}") from None
    if w < 1 or e < 2:
        raise ValueError(f"{what}: window >= 1 and explore >= 2, got {value!r}")
    return w, e


def _cost_table(spec, v2: bool, control: str, tensor_parallel: int) -> str | None:
    key = "ddtree_cost_table"
    value = getattr(spec, key, None)
    applies = not v2 and control == "auto"
    old = _old(key)[1]
    if value is not None and not applies:
        raise ValueError(f"{key} is the step-cost table of ddtree_budget_control='auto' "
                         "on the V1 runner, which this engine does not run: drop it")
    if value is None and applies:
        value = old
    if applies and value is None and tensor_parallel > 1:
        # each rank would pick its table by its own GPU name: ranks must choose alike
        raise ValueError("ddtree_budget_control='auto' with tensor parallelism needs one "
                         "step-cost table for every rank: set ddtree_cost_table (a JSON "
                         "file, bench/gpu/step_bench.py)")
    return None if value is None else str(value)
