"""DFlash drafters with sliding-window layers on vLLM's V1 runner.

Added to vLLM by ddtree-patch (transform ``dflash-swa``; ``ddtree-patch revert`` removes
it).  Small hooks in ``vllm/v1/spec_decode/dflash.py`` (and, on 0.20.x, in
``vllm/model_executor/models/qwen3_dflash.py``) call into this module.

* ``resolve_layer_attention(config, i)``: ``(sliding_window, causal)`` of draft layer
  ``i`` with the precedence of upstream vLLM 0.25+ (``layer_types``,
  ``dflash_config.use_swa``, ``dflash_config.swa_window_size``, top-level
  ``sliding_window``; ``is_causal`` / ``dflash_config.causal``).  Unknown layer types
  and a sliding layer without a window size are refused: never silent full attention.
* ``DFlashGroups``: once a draft layer has a sliding window, vLLM's hybrid KV-cache
  manager gives each attention kind its own KV-cache group (own blocks, own block
  table).  The stock V1 ``DFlashProposer`` knows one group; with ``DFlashGroups`` it
  drafts with one block table, slot mapping, causality and attention metadata per
  group, and writes the context K/V of every draft layer into its own group's blocks.

Only torch is imported at module level (the model file imports this module).
"""

from __future__ import annotations

import copy

import torch

SLIDING = "sliding_attention"
FULL = "full_attention"
KNOWN_LAYER_TYPES = (FULL, SLIDING)
PAD_SLOT_ID = -1  # the KV writers skip negative slots


# ------------------------------------------------------------------ per-layer config


def validate_layer_types(config) -> None:
    """Refuse ``layer_types`` this drafter cannot honour instead of running them as
    full attention."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return
    n = getattr(config, "num_hidden_layers", None)
    if n is not None and len(layer_types) != n:
        raise ValueError(
            f"DFlash drafter config: layer_types has {len(layer_types)} entries but "
            f"num_hidden_layers is {n}")
    unknown = sorted({str(t) for t in layer_types if t not in KNOWN_LAYER_TYPES})
    if unknown:
        raise ValueError(
            f"DFlash drafter config: layer_types {unknown} are not supported (only "
            f"{', '.join(KNOWN_LAYER_TYPES)}); refusing instead of running those layers "
            "as full attention")


def layer_causal(config, layer_idx: int) -> bool:
    """Causality of one draft layer (upstream ``_dflash_layer_causal``): ``is_causal``,
    else ``dflash_config.causal``, else causal exactly for ``sliding_attention``
    layers of ``layer_types``, else non-causal."""
    is_causal = getattr(config, "is_causal", None)
    if is_causal is not None:
        return bool(is_causal)
    override = (getattr(config, "dflash_config", None) or {}).get("causal")
    if override is not None:
        return bool(override)
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return False
    return layer_types[layer_idx] == SLIDING


def resolve_layer_attention(config, layer_idx: int) -> tuple[int | None, bool]:
    """``(sliding_window, causal)`` of draft layer ``layer_idx``.

    ``layer_types`` given: layer i slides iff ``layer_types[i] == "sliding_attention"``,
    except that ``dflash_config.use_swa`` with an all-full ``layer_types`` makes every
    layer slide.  No ``layer_types``: every layer slides iff ``use_swa``.  The window is
    ``dflash_config.swa_window_size``, else the top-level ``sliding_window``; a sliding
    layer without either is an error.  (Same table as upstream 0.25+.)
    """
    validate_layer_types(config)
    dflash_config = getattr(config, "dflash_config", None) or {}
    layer_types = getattr(config, "layer_types", None)
    use_swa = bool(dflash_config.get("use_swa", False))
    any_sliding = bool(layer_types) and any(t == SLIDING for t in layer_types)
    if layer_types is None or (use_swa and not any_sliding):
        is_sliding = use_swa
    else:
        is_sliding = layer_types[layer_idx] == SLIDING
    window = None
    if is_sliding:
        window = dflash_config.get("swa_window_size", getattr(config, "sliding_window", None))
        if window is None:
            raise ValueError(
                "DFlash sliding attention requires a window size configured in "
                "dflash_config.swa_window_size or the top-level sliding_window.")
        window = int(window)
        if window <= 0:
            raise ValueError(f"DFlash sliding window must be positive, got {window}")
    return window, layer_causal(config, layer_idx)


def layer_index_from_prefix(config, prefix: str) -> int:
    """Checkpoint-local layer index of a draft decoder layer from its module prefix
    (``...layers.{target_layer_count + i}``), for callers that do not pass it."""
    try:
        global_idx = int(prefix.rsplit("layers.", 1)[1].split(".", 1)[0])
    except (IndexError, ValueError):
        raise ValueError(f"cannot tell the DFlash draft layer index from {prefix!r}")
    return global_idx - int(getattr(config, "target_layer_count", 0) or 0)


# ------------------------------------------------------------------ proposer side


def _unwrap(model):
    for _ in range(4):
        if hasattr(model, "get_draft_kv_cache_layer_names"):
            return model
        inner = getattr(model, "unwrap", None)
        model = inner() if callable(inner) else getattr(model, "runnable", model)
    return model


def _impl_window(impl):
    w = getattr(impl, "sliding_window", None)
    if w in (None, -1, (-1, -1)) or (isinstance(w, (tuple, list)) and tuple(w) == (-1, -1)):
        return None
    return w


class DFlashGroups:
    """Per-KV-cache-group drafting state of one ``DFlashProposer``.

    Built by ``DFlashProposer.initialize_attn_backend`` (``setup``) when the draft
    layers span several KV-cache groups, or when a group's causality differs from
    the proposer's single (stock) setting; otherwise the stock single-group path runs
    unchanged and ``setup`` returns None.
    """

    def __init__(self, proposer, runner, attn_groups, layer_gid, gid_causal, layer_order):
        self.p = proposer
        self.runner = runner
        self.attn_groups = attn_groups
        self.layer_gid = layer_gid  # draft layer name -> KV cache group id
        self.gid_causal = gid_causal  # group id -> causal
        self.layer_order = layer_order  # draft layer names in model layer order
        self.gids = sorted(gid_causal)
        self.primary = min(self.gids)
        dev = proposer.device
        n_ctx = int(proposer.max_num_tokens)
        n_q = int(getattr(proposer, "max_padded_query_tokens", 0)
                  or getattr(proposer, "max_query_tokens"))
        # persistent per-group buffers (stable addresses for CUDA graphs)
        self.ctx_slots = {g: torch.full((n_ctx,), PAD_SLOT_ID, dtype=torch.int64, device=dev)
                          for g in self.gids}
        self.query_slots = {g: torch.full((n_q,), PAD_SLOT_ID, dtype=torch.int64,
                                          device=dev) for g in self.gids}
        self.block_tables: dict[int, torch.Tensor] = {}
        self.num_query = 0

    # ---------------------------------------------------------------- setup

    @classmethod
    def setup(cls, proposer, kv_cache_config, kernel_block_sizes, stock_init,
              two_sided_windows: bool = False):
        """Initialise the draft attention groups; returns a DFlashGroups, or None when
        the stock single-group path (``stock_init``) is enough.  ``two_sided_windows``:
        give non-causal windowed layers a two-sided window (backends of 0.20.x keep the
        causal one-sided default even for non-causal attention)."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        names = set(proposer._draft_attn_layer_names)
        layers = get_layers_from_vllm_config(proposer.vllm_config, AttentionLayerBase)
        layer_gid: dict[str, int] = {}
        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            for name in group.layer_names:
                if name in names:
                    layer_gid[name] = gid
        missing = sorted(names - set(layer_gid))
        if missing:
            raise RuntimeError(f"DFlash draft layers without a KV cache group: {missing}")

        model = _unwrap(proposer.model)
        default_causal = bool(getattr(proposer, "dflash_causal", False))
        if hasattr(model, "get_draft_kv_cache_layer_names"):
            order = list(model.get_draft_kv_cache_layer_names())
            causal_list = (list(model.get_draft_attn_causal())
                           if hasattr(model, "get_draft_attn_causal")
                           else [default_causal] * len(order))
        else:
            order = sorted(names)
            causal_list = [default_causal] * len(order)
        if set(order) != names:
            raise RuntimeError("DFlash draft layer names do not match the model's layers: "
                               f"{sorted(names)} vs {order}")
        layer_causal_map = dict(zip(order, causal_list))

        gid_causal: dict[int, bool] = {}
        for name in order:
            gid, c = layer_gid[name], bool(layer_causal_map[name])
            if gid_causal.setdefault(gid, c) != c:
                raise ValueError(
                    f"DFlash draft layers of KV cache group {gid} mix causal and "
                    "non-causal attention; one attention metadata serves the whole group, "
                    "so this drafter cannot run (set dflash_config.causal to make every "
                    "layer the same)")

        _check_windows(layers, order, layer_causal_map, two_sided_windows)

        if len(gid_causal) == 1 and next(iter(gid_causal.values())) == default_causal:
            stock_init(kv_cache_config, kernel_block_sizes)
            return None

        attn_groups = _attention_groups(proposer, kv_cache_config, kernel_block_sizes,
                                        layers, order, layer_gid)
        proposer.draft_attn_groups = attn_groups
        primary = min(gid_causal)
        proposer.kv_cache_gid = primary
        first = next(g for g in attn_groups if g.kv_cache_group_id == primary)
        proposer.block_size = _builder_spec(first).block_size
        return cls(proposer, getattr(proposer, "dflash_swa_runner", None), attn_groups,
                   layer_gid, gid_causal, order)

    # ---------------------------------------------------------------- per step

    def _block_table(self, gid: int, cad, batch_size: int):
        if self.runner is None:
            raise RuntimeError("DFlash with several KV cache groups needs the model runner "
                               "(DFlashProposer was built without runner=)")
        bt = self.runner.input_batch.block_table[gid]
        if getattr(bt, "dcp_world_size", 1) * getattr(bt, "pcp_world_size", 1) > 1:
            raise NotImplementedError("DFlash with several KV cache groups does not support "
                                      "context parallelism")
        table = cad.block_table_tensor if gid == self.primary else \
            bt.get_device_tensor(batch_size)
        return table[:batch_size], int(bt.block_size)

    def prepare(self, cad, num_context: int, num_query: int, num_query_per_req: int) -> None:
        """Slot mappings of every group for this step's context rows and query rows
        (the stock kernel already wrote positions, input ids and sample indices)."""
        p = self.p
        batch_size = int(cad.num_reqs)
        dev = p.device
        ctx_pos = p._context_positions_buffer[:num_context].to(torch.int64)
        q_pos = p.positions[:num_query].to(torch.int64)
        ends = cad.query_start_loc[1: batch_size + 1].to(torch.int64)
        ctx_req = torch.searchsorted(ends, torch.arange(num_context, device=dev),
                                     right=True).clamp_(max=max(batch_size - 1, 0))
        q_req = torch.arange(num_query, device=dev) // num_query_per_req
        self.block_tables = {}
        for gid in self.gids:
            table, bs = self._block_table(gid, cad, batch_size)
            self.block_tables[gid] = table
            self.ctx_slots[gid][:num_context].copy_(_slots(table, bs, ctx_req, ctx_pos))
            self.query_slots[gid][:num_query].copy_(_slots(table, bs, q_req, q_pos))
        self.num_query = num_query

    def context_slots(self, num_context: int) -> list[torch.Tensor]:
        """Per draft layer (model order): where its context K/V goes."""
        return [self.ctx_slots[self.layer_gid[n]][:num_context] for n in self.layer_order]

    def slot_mapping(self, num_tokens: int) -> dict[str, torch.Tensor]:
        """Per draft layer: where its query K/V goes (padding rows write nothing)."""
        out = {}
        for gid in self.gids:
            buf = self.query_slots[gid]
            if num_tokens > self.num_query:
                buf[self.num_query:num_tokens].fill_(PAD_SLOT_ID)
            view = buf[:num_tokens]
            for name in self.layer_order:
                if self.layer_gid[name] == gid:
                    out[name] = view
        return out

    def build_attn_metadata(self, cad, draft_index: int = 0):
        per_group, per_layer = [], {}
        n = int(cad.num_actual_tokens)
        for g in self.attn_groups:
            gid = g.kv_cache_group_id
            if gid not in self.block_tables:
                raise RuntimeError("DFlash per-group slot mappings were not prepared")
            cm = copy.copy(cad)
            cm.block_table_tensor = self.block_tables[gid]
            cm.slot_mapping = self.query_slots[gid][:n]
            cm.causal = self.gid_causal[gid]
            build = getattr(g, "build_metadata_for_drafting", None)
            if build is not None:
                md = build(common_attn_metadata=cm, draft_index=draft_index)
            else:
                md = g.get_metadata_builder().build_for_drafting(
                    common_attn_metadata=cm, draft_index=draft_index)
            got = getattr(md, "causal", None)
            if (not self.gid_causal[gid] and got is not False) or \
                    (self.gid_causal[gid] and got is False):
                raise RuntimeError(
                    f"attention metadata of DFlash draft layers {g.layer_names} does not "
                    f"honour causal={self.gid_causal[gid]} ({type(md).__name__}); use an "
                    "attention backend with non-causal support, e.g. FlashAttention")
            per_group.append(md)
            for name in g.layer_names:
                per_layer[name] = md
        return per_group, per_layer


def _slots(table: torch.Tensor, block_size: int, req: torch.Tensor, pos: torch.Tensor):
    col = torch.clamp(pos // block_size, max=table.shape[1] - 1)
    blk = table[req, col].to(torch.int64)
    slot = blk * block_size + pos % block_size
    # block 0 is the null block: sliding-window positions already evicted map there
    return torch.where(blk > 0, slot, torch.full_like(slot, PAD_SLOT_ID))


def _builder_spec(group):
    try:
        return group.get_metadata_builder().kv_cache_spec
    except Exception:  # noqa: BLE001 - builders without a spec attribute
        return group.kv_cache_spec


def _check_windows(layers, order, layer_causal_map, two_sided: bool) -> None:
    """Every draft layer configured with a window must get it from its attention
    backend.  With ``two_sided``, a non-causal windowed layer whose backend keeps a
    one-sided ``(w - 1, 0)`` window gets ``(w - 1, w - 1)`` (what upstream 0.25+
    FlashAttention does at run time)."""
    for name in order:
        layer = layers[name]
        want = getattr(layer, "sliding_window", None)
        if want is None:
            continue
        backend = layer.get_attn_backend()
        supports = getattr(backend, "supports_sliding_window", None)
        impl = getattr(layer, "impl", None)
        if (callable(supports) and not supports()) or impl is None or \
                _impl_window(impl) is None:
            raise ValueError(
                f"DFlash draft layer {name} has sliding window {want} but its attention "
                f"backend {backend.get_name()} does not apply it; refusing to run it as "
                "full attention")
        w = impl.sliding_window
        if two_sided and not layer_causal_map[name] and isinstance(w, tuple) and len(w) == 2 \
                and w[0] >= 0 and w[1] == 0:
            impl.sliding_window = (w[0], w[0])


def _attention_groups(proposer, kv_cache_config, kernel_block_sizes, layers, order,
                      layer_gid):
    """One AttentionGroup per (KV cache group, backend), its metadata builder made
    with every layer it serves."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
    from vllm.v1.worker.utils import AttentionGroup

    members: dict[tuple[int, str], list[str]] = {}
    backends = {}
    for name in sorted(order, key=lambda n: (layer_gid[n], n)):
        backend = layers[name].get_attn_backend()
        key = (layer_gid[name], backend.full_cls_name())
        members.setdefault(key, []).append(name)
        backends[key] = backend
    out = []
    for key, names in members.items():
        gid = key[0]
        spec = kv_cache_config.kv_cache_groups[gid].kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[names[0]]
        kbs = (kernel_block_sizes[gid] if kernel_block_sizes is not None
               and gid < len(kernel_block_sizes) else None)
        group = AttentionGroup(backend=backends[key], layer_names=list(names),
                               kv_cache_spec=spec, kv_cache_group_id=gid)
        group.create_metadata_builders(proposer.vllm_config, proposer.device,
                                       kernel_block_size=kbs)
        out.append(group)
    return out
