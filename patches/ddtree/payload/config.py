"""DDTree settings on SpeculativeConfig, and what DDTree refuses (clearly, up front)."""

from __future__ import annotations

from . import envs, log, settings

METHOD = "ddtree"

# DDTree on vLLM's V2 model runner (0.32/0.33: vllm/v1/worker/gpu/): where vLLM chooses
# the runner (VLLM_USE_V2_MODEL_RUNNER unset), DDTree lets it pick V2 on CUDA, where it
# is proven (bench/RESULTS.md, run 5), and keeps V1 elsewhere (CPU).
# VLLM_USE_V2_MODEL_RUNNER=0/1 picks the runner for DDTree as for everything else.
V2_DEFAULT = True


def _on_cuda() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cuda())
    except Exception:  # no vLLM platform to ask: stay on V1
        return False


def runner_env():
    """vLLM's VLLM_USE_V2_MODEL_RUNNER: True / False, or None where vLLM chooses."""
    try:
        import vllm.envs as vllm_envs

        return vllm_envs.VLLM_USE_V2_MODEL_RUNNER
    except Exception:  # noqa: BLE001  (no vLLM to ask: vLLM chooses)
        return None


def ddtree_v2_enabled() -> bool:
    """May DDTree run on vLLM's V2 model runner (VllmConfig's unsupported features)?
    Where VLLM_USE_V2_MODEL_RUNNER=1 asks for it, yes; where vLLM chooses, on CUDA
    (V2_DEFAULT), not elsewhere, or as the deprecated VLLM_DDTREE_V2=0/1 says."""
    if runner_env():
        return True
    old = envs.deprecated("VLLM_DDTREE_V2")
    if old is not None:
        return envs.flag(old, "VLLM_DDTREE_V2")
    return V2_DEFAULT and _on_cuda()


def check_runner_choice(vllm_config, use_v2) -> None:
    """VLLM_USE_V2_MODEL_RUNNER (``use_v2``: None, True or False) picks the runner; the
    deprecated VLLM_DDTREE_V2 may not contradict it, and 0.20.x (no V2 hooks) keeps V1."""
    if not hasattr(vllm_config, "use_v2_model_runner"):  # 0.20.x
        if use_v2:
            raise ValueError("method='ddtree' runs on the V1 model runner of this vLLM "
                             "(0.20.x): unset VLLM_USE_V2_MODEL_RUNNER")
        return
    old = envs.deprecated("VLLM_DDTREE_V2")
    if use_v2 is not None and old is not None and \
            envs.flag(old, "VLLM_DDTREE_V2") != bool(use_v2):
        raise ValueError(f"VLLM_DDTREE_V2={old} (deprecated) contradicts "
                         f"VLLM_USE_V2_MODEL_RUNNER={int(bool(use_v2))}: drop "
                         "VLLM_DDTREE_V2 (VLLM_USE_V2_MODEL_RUNNER picks the runner)")


def ddtree_async_enabled(vllm_config) -> bool:
    """May this engine keep vLLM's async scheduling (async_scheduling, default on)?
    Only on the V2 runner, whose verify -> walk -> commit -> propose path runs on the
    device without host syncs (fp32 DDTree == no-spec 8/8 with it under FULL CUDA
    graphs on the H200, bench/RESULTS.md run 6); V1 stays synchronous.  The deprecated
    VLLM_DDTREE_ASYNC=0 still means async_scheduling=False for one release."""
    old = envs.deprecated("VLLM_DDTREE_ASYNC")
    if old is not None and not envs.flag(old, "VLLM_DDTREE_ASYNC"):
        return False
    return _uses_v2(vllm_config)


def _uses_v2(vllm_config) -> bool:
    try:  # 0.20.x has no V2 runner (no such property)
        return bool(getattr(vllm_config, "use_v2_model_runner", False))
    except ValueError:  # a bad setting: a config-time error
        raise
    except Exception:  # noqa: BLE001  (a config it cannot judge: say V1)
        return False


# the speculative_config keys of DDTree (docs/configuration.md)
KEYS = ("ddtree_depth", "ddtree_synthetic", "ddtree_budget_control", "ddtree_budgets",
        "ddtree_chain_budget", "ddtree_split_attn", "ddtree_build_graphs",
        "ddtree_chain_graphs", "ddtree_arms", "ddtree_cost_table")


def ddtree_pre_init(spec) -> None:
    """method="ddtree" -> a DFlash drafter whose drafts become a tree of B nodes.

    Runs first in SpeculativeConfig.__post_init__.  Every DFlash code path keeps
    seeing method "dflash"; ``ddtree_budget`` (B) switches the tree on.
    """
    knobs = [k for k in KEYS if getattr(spec, k, None) is not None]
    if getattr(spec, "ddtree_config", None) is not None:
        raise ValueError("ddtree_config is set by DDTree itself: drop it")
    if spec.method != METHOD:
        if knobs or settings.enabled(spec):
            raise ValueError(f"{', '.join(knobs) or 'ddtree_budget'} needs "
                             f"method='{METHOD}'")
        return
    if spec.model is None:
        raise ValueError("method='ddtree' needs a DFlash drafter: pass "
                         "speculative_config['model']")
    if spec.num_speculative_tokens is None:
        raise ValueError("method='ddtree' needs num_speculative_tokens = the tree budget "
                         "B (number of draft nodes verified per step)")
    spec.method = "dflash"
    spec.ddtree_budget = spec.num_speculative_tokens


def ddtree_post_init(spec) -> None:
    """Checks once the draft model config exists (end of __post_init__)."""
    if not settings.enabled(spec):
        return
    hf = spec.draft_model_config.hf_config if spec.draft_model_config else None
    dflash_config = getattr(hf, "dflash_config", None)
    if not isinstance(dflash_config, dict):
        raise ValueError("method='ddtree' needs a DFlash drafter (its config has no "
                         "dflash_config); got architectures "
                         f"{getattr(hf, 'architectures', None)}")
    if spec.ddtree_depth is None:
        block = drafter_block_size(hf)
        spec.ddtree_depth = int(block) - 1 if block and int(block) > 1 else 15
    if spec.ddtree_depth < 1:
        raise ValueError(f"ddtree_depth must be >= 1, got {spec.ddtree_depth}")
    vocab = getattr(hf, "vocab_size", None) or getattr(hf, "draft_vocab_size", None)
    if vocab and spec.ddtree_budget > spec.ddtree_depth * int(vocab):
        raise ValueError(f"ddtree budget {spec.ddtree_budget} exceeds depth x vocab "
                         f"({spec.ddtree_depth} x {vocab}): no tree that large exists")
    # draft_sample_method exists from 0.2x on; 0.20.x names the default rejection
    # sampler "strict" where later releases say "standard"
    if getattr(spec, "draft_sample_method", "greedy") != "greedy":
        raise ValueError("method='ddtree' builds its tree from the drafter's "
                         "distributions: draft_sample_method must stay 'greedy'")
    if getattr(spec, "rejection_sample_method", "standard") not in ("standard", "strict"):
        raise ValueError("method='ddtree' verifies with its own tree sampler: "
                         "rejection_sample_method must stay 'standard'")
    if getattr(spec, "disable_padded_drafter_batch", False):
        raise ValueError("method='ddtree' needs the padded drafter batch "
                         "(disable_padded_drafter_batch=False)")
    check_budget_control(spec)
    check_chain_budget(spec)


def check_chain_budget(spec) -> None:
    """ddtree_chain_budget: 0 (no chain steps) or 1..min(L, B) (a chain of K drafts
    needs K drafter positions)."""
    c = getattr(spec, "ddtree_chain_budget", None)
    if c is None:
        return
    top = min(spec.ddtree_depth, spec.ddtree_budget)
    if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= top:
        raise ValueError(f"ddtree_chain_budget must be 0 (no chain steps) or a draft count "
                         f"in 1..{top} (min(ddtree_depth, num_speculative_tokens)); "
                         f"got {c!r}")


def check_budget_control(spec) -> None:
    """ddtree_budget_control is 'off' or 'auto'; ddtree_budgets lie in 1..B."""
    from .core.budget import control_mode

    mode = control_mode(spec)
    budgets = getattr(spec, "ddtree_budgets", None)
    if budgets is None:
        return
    if mode != "auto":
        raise ValueError("ddtree_budgets needs ddtree_budget_control='auto'")
    bad = [b for b in budgets if not isinstance(b, int) or not 1 <= b <= spec.ddtree_budget]
    if not budgets or bad:
        raise ValueError(f"ddtree_budgets must be budgets in 1..{spec.ddtree_budget} "
                         f"(num_speculative_tokens); got {list(budgets)}")


def drafter_block_size(hf) -> int | None:
    """The drafter's trained block size: top-level ``block_size`` (z-lab's first
    layout) or ``dflash_config.block_size`` (their later, nested layout)."""
    block = getattr(hf, "block_size", None)
    if block is None and isinstance(getattr(hf, "dflash_config", None), dict):
        block = hf.dflash_config.get("block_size")
    return block


try:  # 0.2x+: the OpenAI server answers a VLLMClientError with HTTP 400 + its message
    from vllm.exceptions import VLLMClientError as _ClientError
except ImportError:  # 0.20.x (or outside vLLM): a ValueError already means HTTP 400
    _ClientError = ValueError
_BASES = (_ClientError,) if issubclass(_ClientError, ValueError) else \
    (_ClientError, ValueError)


class DDTreeRequestError(*_BASES):
    """A refused request feature: a ValueError, and on 0.32's server an HTTP 400 with
    the message (its request path turns a plain ValueError into a bare HTTP 500)."""


def request_features(params) -> list[str]:
    """The request features of ``params`` beyond plain sampling, by name."""
    out = []
    if params.logprobs is not None:
        out.append("logprobs")
    if params.presence_penalty or params.frequency_penalty or \
            params.repetition_penalty != 1.0:
        out.append("presence/frequency/repetition penalties")
    for name in ("bad_words", "logit_bias", "allowed_token_ids", "min_tokens", "min_p"):
        if getattr(params, name, None):
            out.append(name)
    if getattr(params, "structured_outputs", None) is not None:
        out.append("structured outputs")
    if getattr(params, "thinking_token_budget", None) is not None:
        out.append("thinking_token_budget")
    if getattr(params, "logprob_token_ids", None):
        out.append("logprob_token_ids")
    return out


# served per tree node on the V1 runner (v1/requests.py; tests/engine/test_ddtree_engine.py);
# structured outputs on 0.32 / 0.33 (v1/grammar.py: 0.20.x has no such hook)
V1_SERVED = ("logprobs", "presence/frequency/repetition penalties", "bad_words",
             "logit_bias", "allowed_token_ids", "min_tokens", "min_p",
             "structured outputs")
# on the V2 runner by V2's own processors per tree node (v2/requests.py), grammars by
# the same scheduler hooks (tests/engine/test_v2_requests.py, test_v2_cpu_engine.py)
V2_SERVED = V1_SERVED


def _v1_served() -> tuple[str, ...]:
    try:
        import vllm

        old = str(getattr(vllm, "__version__", "")).startswith("0.20")
    except Exception:  # noqa: BLE001  (outside vLLM: the tests' stand-in)
        old = False
    return V1_SERVED[:-1] if old else V1_SERVED


def validate_request(params, spec=None) -> None:
    """Request features the tree sampler does not serve on this engine's runner are
    refused per request (instead of silently ignoring them, which would change the
    output).  ``spec``: the engine's SpeculativeConfig (None: an engine whose runner
    is unknown refuses them all)."""
    v2 = spec is not None and settings.of(spec).v2
    served = () if spec is None else V2_SERVED if v2 else _v1_served()
    bad = [f for f in request_features(params) if f not in served]
    if spec is not None and not v2 and params.logprobs is not None and params.logprobs < 0:
        bad.append("logprobs=-1 (the whole vocabulary)")
    if bad:
        where = "this engine" if spec is None else \
            "vLLM's V2 model runner" if v2 else "the V1 runner"
        raise DDTreeRequestError("speculative method 'ddtree' does not support "
                                 + ", ".join(bad) + f" on {where} yet; drop them or "
                                 "serve without DDTree")


def ddtree_metrics_info(stat_logger, vllm_config) -> None:
    """/metrics names the method (the spec-decode counters carry no method label):
    vllm:spec_decode_config_info{method="ddtree", num_speculative_tokens=B,
    ddtree_depth=L, ...} 1, set up in PrometheusStatLogger.__init__."""
    spec = vllm_config.speculative_config
    gauge = stat_logger._gauge_cls(
        name="vllm:spec_decode_config_info",
        documentation="Speculative decoding method and its settings.",
        multiprocess_mode="mostrecent",
        labelnames=["model_name", "engine", "method", "num_speculative_tokens",
                    "ddtree_depth", "draft_model"])
    for labelvalues in stat_logger.per_engine_labelvalues.values():
        gauge.labels(*labelvalues, METHOD, str(spec.ddtree_budget), str(spec.ddtree_depth),
                     str(spec.draft_model_config.model)).set(1)


def ddtree_vllm_config(vllm_config) -> None:
    """Engine-wide settings DDTree needs (start of VllmConfig.__post_init__); the
    engine's DDTreeConfig (settings.py) goes to speculative_config.ddtree_config."""
    sched = vllm_config.scheduler_config
    check_runner_choice(vllm_config, runner_env())
    if not ddtree_async_enabled(vllm_config):
        if sched.async_scheduling:
            why = "with VLLM_DDTREE_ASYNC=0 (deprecated)" if _uses_v2(vllm_config) \
                else "on the V1 runner"
            raise ValueError(f"method='ddtree' runs with synchronous scheduling {why}: "
                             "drop async_scheduling=True (--async-scheduling)")
        sched.async_scheduling = False
    refuse_parallelism(vllm_config.parallel_config)
    refuse_recurrent_target(vllm_config)
    refuse_processed_logprobs(vllm_config.model_config)
    spec = getattr(vllm_config, "speculative_config", None)
    default_batch_policy(vllm_config, spec)
    if settings.enabled(spec):
        tp = getattr(vllm_config.parallel_config, "tensor_parallel_size", 1)
        cfg = settings.build(spec, _uses_v2(vllm_config), tp)
        # vLLM re-runs this hook on copies of the config (dataclasses.replace): the same
        # settings keep their object, whose channel the scheduler and worker may hold
        if getattr(spec, "ddtree_config", None) != cfg:
            spec.ddtree_config = cfg


def refuse_processed_logprobs(model_config) -> None:
    """The tree sampler returns the raw logprobs of the emitted tokens (vLLM's default
    logprobs_mode); processed ones are refused when the engine is built."""
    mode = getattr(model_config, "logprobs_mode", "raw_logprobs")
    if mode not in ("raw_logprobs", "raw_logits"):
        raise ValueError(f"method='ddtree' returns raw logprobs: logprobs_mode={mode!r} "
                         "is not supported yet; use 'raw_logprobs' (the default) or "
                         "'raw_logits'")


def unsupported_parallelism(par) -> list[tuple[str, str]]:
    """(kind, refusal with what to do) for every kind of parallelism in ``par`` that
    DDTree does not run yet; tensor parallelism runs (every rank builds and walks the
    same trees).  config.py refuses the first at configuration, the V2 runtime names
    them all (v2/runtime.py: check_runner)."""
    tp = "tensor parallelism (--tensor-parallel-size) is supported"
    out = []
    pp = getattr(par, "pipeline_parallel_size", 1)
    if pp > 1:
        out.append(("pipeline parallelism", "method='ddtree' does not support pipeline "
                    f"parallelism yet (pipeline_parallel_size={pp}): use tensor "
                    f"parallelism instead; {tp}"))
    dp = getattr(par, "data_parallel_size", 1)
    if dp > 1:
        out.append(("data parallelism", "method='ddtree' does not support data "
                    f"parallelism yet (data_parallel_size={dp}): run one engine per "
                    "replica behind a load balancer instead; " + tp))
    if getattr(par, "enable_expert_parallel", False) or getattr(par, "enable_eplb", False):
        out.append(("expert parallelism", "method='ddtree' is not proven with expert "
                    "parallelism yet: drop enable_expert_parallel / enable_eplb "
                    f"(--enable-expert-parallel, --enable-eplb); {tp}"))
    if getattr(par, "enable_dbo", False) or getattr(par, "ubatch_size", 0) > 1 or \
            getattr(par, "use_ubatching", False):
        out.append(("micro-batching (DBO)", "method='ddtree' does not support "
                    "micro-batching (dual batch overlap) yet: drop enable_dbo / "
                    "ubatch_size (--enable-dbo)"))
    for name, flag in (("decode_context_parallel_size", "--decode-context-parallel-size"),
                       ("prefill_context_parallel_size", "--prefill-context-parallel-size")):
        size = getattr(par, name, 1)
        if size > 1:
            out.append(("context parallelism (PCP/DCP)", "method='ddtree' does not "
                        f"support context parallelism yet ({name}={size}): leave {flag} "
                        f"at 1; {tp}"))
    return out


def refuse_parallelism(par) -> None:
    """Refuse the first kind of parallelism DDTree does not run (unsupported_parallelism)."""
    bad = unsupported_parallelism(par)
    if bad:
        raise ValueError(bad[0][1])


def refuse_recurrent_target(vllm_config) -> None:
    """Targets with recurrent layers (Gated DeltaNet, Mamba, linear attention) keep a
    per-request state and short convolution that a plain verify would run over the
    tree as one linear sequence: wrong for every node off the first path.  Refused,
    except where the tree path exists (gdn.py)."""
    model_config = vllm_config.model_config
    if model_config is None:
        return
    if not (model_config.is_hybrid or model_config.is_attention_free
            or getattr(model_config, "has_inner_state", False)):
        return
    from .gdn.cpu import unsupported_reason

    why = unsupported_reason(vllm_config)
    if why is None:
        return
    text = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    kinds = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None)
    kinds = sorted(set(kinds)) if kinds else "recurrent"
    raise ValueError(
        f"method='ddtree' does not support targets with recurrent layers (Gated "
        f"DeltaNet / Mamba / linear attention) here: "
        f"{getattr(model_config.hf_config, 'architectures', None)} has layer types "
        f"{kinds}; {why}. Or serve it with method='dflash' (a chain) or without "
        f"speculation.")


# The budget per batch size DDTree sets on the V2 runner when the user set none: a tree
# at 1 and 2 requests, chain steps (the DFlash chain's cost) from 3 on.  Each tree is
# cut to end 1 + drafts on a ROW_TILE multiple (B = 64 -> 63, 32 -> 31), and at 2
# requests it is B // 2 each but no fewer than TWO_REQ_DRAFTS.  H100, Qwen3-8B shape
# (bench/RESULTS.md "#29: the step by kernel"): 1 + 63 rows cost 1.13x the chain's step
# against 1.14x for 65, and 2 x 64 rows 1.16x against 1.28x for 2 x 65 (the GEMMs and
# the tree attention both pad the 65th row to a new tile); end to end a fixed B = 63
# tree beat a fixed B = 64 in all 8 cells at 1-2 requests, and at 2 requests the old
# default's B // 2 (with the choice) in 3 of 4.
ROW_TILE = 16
TWO_REQ_DRAFTS = 63


def on_tile(d: int, c: int) -> int:
    """The largest t <= d with 1 + t a ROW_TILE multiple, where t stays above the chain
    C; else d (a tree no longer than the chain plays nothing the chain does not)."""
    t = (d + 1) // ROW_TILE * ROW_TILE - 1
    return t if t > c else d


def default_schedule(b: int, c: int) -> list:
    """DDTree's V2 schedule for budget B and chain C: [[lo, hi, drafts], ...]."""
    one = on_tile(b, c)
    two = on_tile(min(b, max(b // 2, TWO_REQ_DRAFTS)), c)
    if two <= c:
        two = one
    if two == one:
        return [[1, 2, one], [3, 1 << 16, c]]
    return [[1, 1, one], [2, 2, two], [3, 1 << 16, c]]


def default_batch_policy(vllm_config, spec) -> None:
    """V2 runner: the budget per batch size and the tree-vs-chain controller.

    Nothing set about budgets (DDTree's V2 default): a tree of about B drafts at 1
    request and of about max(B // 2, 63) at 2, each ending on a 16-row tile, a chain of
    C = min(L, B - 1) drafts from 3 on (``default_schedule``), and
    ddtree_budget_control='auto': at the tree batch sizes the scheduler plays the tree
    or the chain, whichever delivers more tokens/s (arms.py).
    'off': that schedule, fixed.  'auto' with the user's schedule: the arms at its batch
    sizes whose budget exceeds C (the user's ddtree_chain_budget, else min(L, B - 1)).
    A schedule or a chain budget alone: kept as given (ddtree_chain_budget=0: B always).
    """
    if not settings.enabled(spec) or not _uses_v2(vllm_config):
        return
    mode = getattr(spec, "ddtree_budget_control", None)
    sched = getattr(spec, "num_speculative_tokens_per_batch_size", None)
    chain = getattr(spec, "ddtree_chain_budget", None)
    if mode is None:
        if sched or chain is not None:
            return  # the user's budgets, as given
        mode = "auto"
    b = spec.ddtree_budget
    c = min(spec.ddtree_depth, b - 1) if chain is None else chain
    if c < 1:
        if getattr(spec, "ddtree_budget_control", None) == "auto":
            raise ValueError(
                "ddtree_budget_control='auto' on the V2 runner chooses between the tree "
                "and a chain of ddtree_chain_budget drafts: it needs a chain of >= 1 "
                f"draft (got ddtree_chain_budget={chain!r}, num_speculative_tokens={b})")
        return  # B = 1: no chain shorter than the tree
    if not sched:
        spec.num_speculative_tokens_per_batch_size = default_schedule(b, c)
    spec.ddtree_chain_budget = c
    spec.ddtree_budget_control = mode
    log(__name__, "DDTree: drafts per batch size %s, chain steps for <= %d drafts; %s",
        spec.num_speculative_tokens_per_batch_size, c,
        "where the budget is a tree, the tree or the chain by tokens/s "
        "(ddtree_budget_control='off' keeps it fixed)" if mode == "auto" else "fixed")
