"""DDTree on Gated DeltaNet hybrids (Qwen3-Next / Qwen3.5 / Qwen3.6), CPU backend
(CUDA: gdn_cuda.py).

With DDTree on, every speculative step of a GDN layer runs here (the ddtree-gdn
transform hooks ``_spec_forward`` of vLLM's ops/cpu/gdn_attention.py):

  tree_spec_forward()  per request, the short convolution over each row's ancestors
      and the tree-masked delta rule from the committed state (core.gdn_tree).  No
      cache is written; what the commit needs (conv inputs, history, h0, the stash
      k / u / G) is kept on the runtime's step.
  gdn_commit()  after the walk (DDTreeRuntime.commit): the state at the last
      accepted row goes to state slot ``a`` (a = accepted drafts; vLLM reads slot
      num_accepted - 1 = a next step) and the last W-1 inputs along the path to conv
      buffer columns [a, a + W - 1) (vLLM reads its history at column a).

A step without a tree (no request drafted: the runtime made no step) has only roots:
those are committed at once (a = 0).  ``unsupported_reason`` is what DDTree refuses
on recurrent targets (config.refuse_recurrent_target).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from ..core.gdn_tree import (conv_commit, conv_windows, gdn_gates, tree_conv1d,
                            tree_gdn_commit, tree_gdn_verify, tree_mask)

GDN_ARCHS = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
             "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
HOOKED = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"  # CPU backend
HOOKED_CUDA = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"  # gdn_cuda.py
HOOK_CALL = "tree_spec_forward("


def _hook_installed(module: str = HOOKED) -> bool:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return False
    with open(spec.origin, encoding="utf-8") as f:
        return HOOK_CALL in f.read()


def unsupported_reason(vllm_config) -> str | None:
    """None when DDTree can verify trees on this recurrent target, else why not."""
    mc = vllm_config.model_config
    kinds = set(getattr(mc.hf_text_config, "layer_types", None) or ())
    archs = getattr(mc.hf_config, "architectures", None) or []
    if not kinds or not kinds <= {"linear_attention", "full_attention"} or \
            not set(archs) & set(GDN_ARCHS):
        return ("only Gated DeltaNet hybrids (Qwen3-Next / Qwen3.5 / Qwen3.6) have a tree "
                "path so far")
    from vllm.platforms import current_platform

    cpu = current_platform.is_cpu()
    if not (cpu or current_platform.is_cuda()):
        return "the tree path for GDN layers runs on CUDA and on vLLM's CPU backend only"
    if not _hook_installed(HOOKED if cpu else HOOKED_CUDA):
        return "the ddtree-gdn transform is not applied: run `ddtree-patch apply`"
    cache = vllm_config.cache_config
    if cache.enable_prefix_caching or getattr(cache, "mamba_cache_mode", "none") != "none":
        return ("prefix caching of the GDN state (mamba_cache_mode 'align', vLLM's default "
                "for hybrids when prefix caching is on) is not handled: pass "
                "enable_prefix_caching=False (--no-enable-prefix-caching)")
    if getattr(cache, "use_replayssm", False):
        return "ReplaySSM is not handled: turn it off"
    if getattr(cache, "use_kda_recoverssm", False):
        return "RecoverSSM is not handled: turn it off"
    if cpu and mc.dtype != torch.bfloat16:
        return "vLLM's CPU GDN kernels run in bfloat16 only: pass dtype='bfloat16'"
    return None


@dataclass
class _Plan:
    """One step's trees as the GDN layers see them (shared by all GDN layers)."""

    rows: torch.Tensor  # [N] batch row of each speculative request
    index: torch.Tensor  # [N, T] token of each verify row in the spec tokens (pads: root)
    valid: torch.Tensor  # [N, T]
    mask: torch.Tensor  # [N, T, T] ancestor-or-self
    windows: torch.Tensor  # [N, T, W] conv windows
    slots: torch.Tensor  # [N, k+1] state slots
    read: torch.Tensor  # [N] slot column / conv offset of the committed state


def _plan(md, step, width: int, dev) -> _Plan:
    plan = getattr(md, "ddtree_gdn_plan", None)
    if plan is not None:
        return plan
    n = md.num_spec_decodes
    qsl = md.spec_query_start_loc[: n + 1].cpu().long()
    lens = (qsl[1:] - qsl[:-1]).tolist()
    masks = md.spec_sequence_masks_cpu
    rows = torch.arange(len(masks))[masks.bool()][:n] if masks is not None \
        else torch.arange(n)
    t = max(lens)
    parents = torch.full((n, max(t - 1, 1)), -1, dtype=torch.int64)
    for j, (i, q) in enumerate(zip(rows.tolist(), lens)):
        d = q - 1
        if d == 0:
            continue
        if step is None or step.num_drafts[i] != d:
            raise RuntimeError(f"DDTree: request row {i} verifies {d} drafts in its GDN "
                               "layers but the runtime has no tree for them")
        parents[j, :d] = step.tree.parents[i, :d].cpu()
    r = torch.arange(t)
    valid = r[None, :] < torch.tensor(lens)[:, None]
    index = qsl[:-1, None] + torch.where(valid, r[None, :], 0)
    parents = parents[:, : t - 1].to(dev)
    plan = _Plan(rows, index.to(dev), valid.to(dev), tree_mask(parents),
                 conv_windows(parents, width), md.spec_state_indices_tensor[:n].long(),
                 md.num_accepted_tokens[:n].long() - 1)
    md.ddtree_gdn_plan = plan
    return plan


@dataclass
class _Pending:
    """One GDN layer's verify, waiting for the walk."""

    plan: _Plan
    conv_buf: torch.Tensor  # (slots, dim, state_len) view of the layer's conv cache
    ssm_state: torch.Tensor  # (slots, HV, K, V) view of the layer's state cache
    x: torch.Tensor  # [N, T, C] conv inputs
    hist: torch.Tensor  # [N, C, W-1] committed conv history
    h0: torch.Tensor  # [N, HV, K, V] committed state
    stash: object  # core.gdn_tree.GDNStash


def tree_spec_forward(layer, md, mixed_qkv, b, a, conv_buf, ssm_state, width: int):
    """The GDN core output [tokens, HV, V] of the speculative requests of this step
    (all requests whose tokens vLLM routes to the spec path), rows as trees."""
    step = getattr(md, "ddtree", None)
    dev = mixed_qkv.device
    plan = _plan(md, step, width, dev)
    x = mixed_qkv[plan.index]  # [N, T, C]
    n, t, c = x.shape
    slot0 = plan.slots[:, 0]
    cols = plan.read[:, None] + torch.arange(width - 1, device=dev)
    hist = conv_buf[slot0].gather(2, cols[:, None, :].expand(-1, c, -1))
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import (
        _unpacked_conv_weight)

    y = tree_conv1d(x, hist, _unpacked_conv_weight(layer), layer.conv1d.bias, plan.windows,
                    silu=layer.activation == "silu")
    nk, nv = layer.num_k_heads // layer.tp_size, layer.num_v_heads // layer.tp_size
    kd, vd = layer.head_k_dim, layer.head_v_dim
    q = y[..., : nk * kd].reshape(n, t, nk, kd)
    k = y[..., nk * kd: 2 * nk * kd].reshape(n, t, nk, kd)
    v = y[..., 2 * nk * kd:].reshape(n, t, nv, vd)
    g, beta = gdn_gates(a[plan.index], b[plan.index], layer.A_log, layer.dt_bias)
    h0 = ssm_state[plan.slots.gather(1, plan.read[:, None])[:, 0]]
    o, stash = tree_gdn_verify(q, k, v, g, beta, h0, plan.mask, scale=kd ** -0.5)
    out = torch.empty(mixed_qkv.shape[0], nv, vd, dtype=mixed_qkv.dtype, device=dev)
    out[plan.index[plan.valid]] = o[plan.valid].to(out.dtype)
    pending = _Pending(plan, conv_buf, ssm_state, x, hist, h0, stash)
    if step is None:  # roots only: nothing to walk
        zero = torch.zeros(n, dtype=torch.int64, device=dev)
        _commit(pending, zero[:, None], zero)
    else:
        if not hasattr(step, "gdn"):
            step.gdn = []
        step.gdn.append(pending)
    return out


def _commit(p: _Pending, rows: torch.Tensor, num: torch.Tensor) -> None:
    plan, w = p.plan, p.hist.shape[2] + 1
    state = tree_gdn_commit(p.h0, p.stash, rows, num)
    p.ssm_state[plan.slots.gather(1, num[:, None])[:, 0]] = state.to(p.ssm_state.dtype)
    hist = conv_commit(p.x, p.hist, plan.windows, rows, num)
    slot0 = plan.slots[:, 0]
    for j in range(w - 1):
        p.conv_buf[slot0, :, num + j] = hist[:, :, j]


def gdn_commit(step, walk) -> None:
    """After the walk: advance every GDN layer's state and conv history along the
    accepted path of each request."""
    pending = getattr(step, "gdn", None)
    if not pending:
        return
    if walk is None:
        raise RuntimeError("DDTree: GDN layers verified a tree but no walk ran; the "
                           "recurrent state cannot be committed")
    rows_all, num_all = walk.accepted_rows.long(), walk.num_accepted.long()
    for p in pending:
        sel = p.plan.rows.to(rows_all.device)
        _commit(p, rows_all[sel], num_all[sel])
    step.gdn = []
