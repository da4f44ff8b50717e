"""DDTree on Gated DeltaNet hybrids (Qwen3.5 / Qwen3.6 / Qwen3-Next) on CUDA, vLLM
0.32 / 0.33, V1 and V2 runners.

With DDTree on, every speculative step of a GDN layer runs its speculative rows here
(the ddtree-gdn transform hooks ``QwenGatedDeltaNetAttention._forward_core``); the
prefill and non-speculative rows of the same batch keep vLLM's kernels (FlashInfer or
Triton/FLA prefill alike).

  tree_spec_forward()  the short convolution over each row's ancestors and the
      tree-masked delta rule from the committed state (core.gdn_tree), for every row
      of every speculative request.  No cache is written: the conv inputs and the
      stash (k, u, G) go to fixed per-layer buffers, flat by speculative token, so
      a FULL CUDA graph captured with this code writes where the commit reads.
  GDNTree.commit()  after the walk (the runtime's commit): the state at the last
      accepted row and the last W-1 conv inputs along the path go to the request's
      one state slot, column 0.

One state slot per request: the tree path reads and writes the committed state in
slot column 0 and never the per-draft slots vLLM's chain keeps (1 + k per request), so
DDTree runs GDN layers with ``num_speculative_blocks = 0`` (gdn/base.py hook) and the
conv state keeps W - 1 columns.  What a step adds is the stash, sized by the most
speculative tokens one step verifies, not by the requests the KV pool holds.

Trees come from the runtime's ``TreeState`` (has_tree, ancestor-or-self mask by batch
row); rows without a tree (chain steps, requests with a chain of drafts) are causal.  A
step whose speculative rows are roots only (no drafts anywhere: no walk follows)
commits at once, inside the forward.  The state cache stores [HV, V, K] per slot
(vLLM's CUDA layout); core.gdn_tree works on [HV, K, V] views of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import gdn_triton
from ..core._triton import use_triton
from ..core.gdn_tree import (GDNStash, gdn_gates, tree_conv1d, tree_gdn_commit,
                             tree_gdn_verify)

ATTR = "ddtree_gdn"  # the GDNTree a GDN layer's hook finds on the layer


def windows_from_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    """[N, T, W] int64 conv windows (indices into [history (W-1), rows (T)], oldest
    first, self last) from an ancestor-or-self mask [N, T, T] (parents precede their
    children, so a row's ancestors in index order are its path in depth order)."""
    anc = mask.bool()
    n, t, _ = anc.shape
    h = width - 1
    # rank from the end of the path: 1 = self, 2 = parent, ...
    rank = anc.flip(-1).long().cumsum(-1).flip(-1) * anc
    count = anc.sum(-1)  # path length (root .. self)
    w = torch.arange(width, device=mask.device)
    want = (width - w).view(1, 1, width, 1)  # rank wanted at window slot w
    hit = rank.unsqueeze(2) == want  # [N, T, W, T]
    s = torch.arange(t, device=mask.device)
    row = (hit.long() * s).sum(-1) + h
    hist = count.unsqueeze(2) + w.view(1, 1, width) - 1
    return torch.where(hit.any(-1), row, hist)


@dataclass
class _Buffers:
    """One GDN layer's step, flat by speculative token (row max_tokens: dump row)."""

    x: torch.Tensor  # [M + 1, C] conv inputs
    k: torch.Tensor  # [M + 1, H, K] float32, l2-normalised
    u: torch.Tensor  # [M + 1, HV, V] float32
    G: torch.Tensor  # [M + 1, HV] float32


class GDNTree:
    """The GDN layers' tree verification of one model runner.  ``tree_state`` is the
    runtime's TreeState (has_tree [R], mask [R, 1+B, 1+B] by batch row); ``depth`` the
    most drafts on one path (ddtree_depth: trees and chains alike), which bounds the
    verify kernel's inverse."""

    def __init__(self, layers, tree_state, max_tokens: int, max_reqs: int, depth: int,
                 device):
        self.tree_state = tree_state
        self.max_tokens = max_tokens
        self.max_reqs = max_reqs
        self.depth = depth
        self.layers = dict(layers)  # prefix -> layer
        self.width = None
        self.backend = "auto"  # core.gdn_tree's backend (tests: "triton" on the CPU)
        self.step_id = 0  # the runtime counts verify steps (note_step)
        self._seen = -1  # step of the last forward that ran in Python (eager)
        self._rows_map = None  # batch row of each speculative row, that step
        self._n = 0
        self._graph_key, self._graphs = None, {}  # the commit's CUDA graphs, by batch size
        self._rows_buf = self._num_buf = None
        m, dev = max_tokens + 1, device
        self.qsl = torch.zeros(max_reqs + 1, dtype=torch.int64, device=dev)
        self.slots = {}  # prefix -> [max_reqs] int64 state slot of each spec row
        self.windows = None  # [M + 1, W] int64, flat by spec token
        self.bufs = {}
        for name, layer in self.layers.items():
            tp = layer.tp_size
            h, hv = layer.num_k_heads // tp, layer.num_v_heads // tp
            kd, vd = layer.head_k_dim, layer.head_v_dim
            c = (2 * layer.key_dim + layer.value_dim) // tp
            w = layer.conv1d.weight.shape[-1]
            if self.width not in (None, w):
                raise NotImplementedError("DDTree GDN: layers with different conv widths")
            self.width = w
            dt = layer.conv1d.weight.dtype
            self.bufs[name] = _Buffers(
                torch.zeros(m, c, dtype=dt, device=dev),
                torch.zeros(m, h, kd, dtype=torch.float32, device=dev),
                torch.zeros(m, hv, vd, dtype=torch.float32, device=dev),
                torch.zeros(m, hv, dtype=torch.float32, device=dev))
            self.slots[name] = torch.zeros(max_reqs, dtype=torch.int64, device=dev)
            setattr(layer, ATTR, self)
        if self.width is not None:
            self.windows = torch.zeros(m, self.width, dtype=torch.int64, device=dev)

    def stash_bytes(self) -> int:
        """Bytes the step buffers hold (all layers)."""
        total = sum(t.numel() * t.element_size() for b in self.bufs.values()
                    for t in (b.x, b.k, b.u, b.G))
        return total + (self.windows.numel() * 8 if self.windows is not None else 0)

    def note_step(self) -> None:
        """The runtime starts a verify step (before its forward)."""
        self.step_id += 1

    # ------------------------------------------------------------------ forward
    def plan(self, md, tokens: int, dev):
        """This step's trees as the GDN layers see them, built by the forward's first
        GDN layer and shared by all (under a CUDA graph its kernels are captured with
        that layer).  Shared through vLLM's forward context, not the metadata: a hybrid
        may give each GDN layer its own KV cache group and metadata object, and a plan
        per layer cost ~3 ms a step on the 27B shape (run 18)."""
        scope = step_scope(md)
        cached = getattr(scope, "ddtree_gdn_plan", None)
        if cached is not None and cached.n == md.num_spec_decodes:
            return cached
        n = md.num_spec_decodes
        t = md.uniform_spec_sequence_length
        if not t:  # ragged (eager only): an upper bound of the longest request
            t = max(1, min(self.tree_state.rows, md.num_spec_decode_tokens - (n - 1)))
        if n > self.max_reqs:
            raise RuntimeError(f"DDTree GDN: {n} speculative requests in one step, more "
                               f"than max_num_seqs ({self.max_reqs})")
        if md.num_prefills == 0 and md.num_decodes == 0:
            rows = torch.arange(n, device=dev)
            rows_map = None
        else:
            rows_cpu = md.spec_sequence_masks_cpu.nonzero().flatten()[:n]
            rows = rows_cpu.to(dev, non_blocking=True)
            rows_map = rows_cpu
        qsl = md.spec_query_start_loc[: n + 1].long()
        lens = qsl[1:] - qsl[:-1]
        ar = torch.arange(t, device=dev)
        valid = ar[None, :] < lens[:, None]  # [N, T]
        index = (qsl[:-1, None] + ar[None, :]).clamp(max=max(tokens - 1, 0))
        index = torch.where(valid, index, qsl[:-1, None].clamp(max=max(tokens - 1, 0)))
        ts = self.tree_state
        r = rows.clamp(max=ts.has_tree.shape[0] - 1)
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        tree = ts.mask[r, :t, :t] != 0
        mask = torch.where((ts.has_tree[r] != 0)[:, None, None], tree, causal)
        eye = torch.eye(t, dtype=torch.bool, device=dev)
        both = valid[:, :, None] & valid[:, None, :]
        mask = torch.where(valid[:, :, None], mask & both, eye) | eye
        windows = windows_from_mask(mask, self.width)
        write = torch.where(valid, qsl[:-1, None] + ar[None, :],
                            torch.full_like(index, self.max_tokens)).reshape(-1)
        self.qsl[: n + 1].copy_(qsl)
        self.windows[write] = windows.reshape(-1, self.width)
        orow = torch.where(valid, index, tokens)
        plan = _Plan(n, t, rows_map, index, valid, mask, windows, write,
                     orow, mask.to(torch.int8), write.view(n, t))
        scope.ddtree_gdn_plan = plan
        self._seen, self._rows_map, self._n = self.step_id, rows_map, n
        return plan

    def forward(self, layer, md, x_all, b, a, conv_state, ssm_state):
        """The core output [1, tokens, HV, V] of the speculative rows (vLLM's layout
        for ``core_attn_out_spec``)."""
        dev = x_all.device
        tokens = x_all.shape[0]
        if md.num_spec_decode_tokens > self.max_tokens:
            raise RuntimeError(
                f"DDTree GDN: a step verifies {md.num_spec_decode_tokens} speculative "
                f"tokens, more than the {self.max_tokens} its buffers hold")
        p = self.plan(md, tokens, dev)
        name = layer.prefix
        buf = self.bufs[name]
        n, t, w = p.n, p.t, self.width
        if conv_state.shape[-1] != w - 1:
            raise RuntimeError(
                f"DDTree GDN: layer {name} keeps {conv_state.shape[-1]} conv state "
                f"columns, the tree path needs {w - 1} (one slot per request: is the "
                "ddtree-gdn hook of gdn/base.py applied?)")
        self.slots[name][:n].copy_(md.spec_state_indices_tensor[:n, 0])  # one launch
        tp = layer.tp_size
        nk, nv = layer.num_k_heads // tp, layer.num_v_heads // tp
        kd, vd = layer.head_k_dim, layer.head_v_dim
        weight = layer.conv1d.weight.view(layer.conv1d.weight.shape[0], -1)
        silu = layer.activation == "silu"
        fwd = self._forward_triton if use_triton(x_all, self.backend) else \
            self._forward_torch
        out = fwd(layer, p, buf, x_all, b, a, conv_state, ssm_state,
                                      weight, silu, (nk, nv, kd, vd))
        if t == 1:  # roots only: no walk follows, commit now
            zero = torch.zeros(n, dtype=torch.int64, device=dev)
            self._commit_layer(name, conv_state, ssm_state, zero[:, None], zero, n)
        return out[:tokens].unsqueeze(0)

    def _forward_triton(self, layer, p, buf, x_all, b, a, conv_state, ssm_state, weight,
                        silu, dims):
        """Two launches: the conv (which also stashes each row's input) and the verify
        (gates, l2 norm, the delta rule; o straight to the output rows, the stash to
        its rows), reading x, a, b and the caches in place."""
        nk, nv, kd, vd = dims
        n, t = p.n, p.t
        tokens = x_all.shape[0]
        slots = self.slots[layer.prefix][:n]
        x_all = x_all if x_all.stride(1) == 1 else x_all.contiguous()
        y = torch.empty(n, t, x_all.shape[1], dtype=x_all.dtype, device=x_all.device)
        gdn_triton.conv1d(x_all, p.index, conv_state, slots, weight, layer.conv1d.bias,
                          p.windows, silu, y, x_stash=buf.x, srow=p.srow)
        q = y[..., : nk * kd].unflatten(2, (nk, kd))
        k = y[..., nk * kd: 2 * nk * kd].unflatten(2, (nk, kd))
        v = y[..., 2 * nk * kd:].unflatten(2, (nv, vd))
        a = a if a.stride(-1) == 1 else a.contiguous()
        b = b if b.stride(-1) == 1 else b.contiguous()
        out = torch.zeros(tokens + 1, nv, vd, dtype=x_all.dtype, device=x_all.device)
        return gdn_triton.verify(q, k, v, a, b, p.index, p.mask8, ssm_state, slots, out,
                                 p.orow, (buf.k, buf.u, buf.G), p.srow, kd ** -0.5,
                                 A_log=layer.A_log, dt_bias=layer.dt_bias, state_kv=False,
                                 depth=self.depth)

    def _forward_torch(self, layer, p, buf, x_all, b, a, conv_state, ssm_state, weight,
                       silu, dims):
        nk, nv, kd, vd = dims
        n, t, w = p.n, p.t, self.width
        tokens = x_all.shape[0]
        slots = self.slots[layer.prefix][:n]
        x = x_all[p.index]  # [N, T, C]
        hist = conv_state[slots, :, : w - 1]  # [N, C, W-1]
        y = tree_conv1d(x, hist, weight, layer.conv1d.bias, p.windows, silu=silu,
                        backend="torch")
        q = y[..., : nk * kd].reshape(n, t, nk, kd)
        k = y[..., nk * kd: 2 * nk * kd].reshape(n, t, nk, kd)
        v = y[..., 2 * nk * kd:].reshape(n, t, nv, vd)
        g, beta = gdn_gates(a[p.index], b[p.index], layer.A_log, layer.dt_bias)
        h0 = ssm_state[slots].transpose(-1, -2)  # [N, HV, K, V]
        o, stash = tree_gdn_verify(q, k, v, g, beta, h0, p.mask, scale=kd ** -0.5,
                                   backend="torch")
        buf.x[p.write] = x.reshape(n * t, -1)
        buf.k[p.write] = stash.k.reshape(n * t, nk, kd)
        buf.u[p.write] = stash.u.reshape(n * t, nv, vd)
        buf.G[p.write] = stash.G.reshape(n * t, nv)
        out = torch.zeros(tokens + 1, nv, vd, dtype=x_all.dtype, device=x_all.device)
        out[p.orow.reshape(-1)] = o.reshape(n * t, nv, vd).to(out.dtype)
        return out

    # ------------------------------------------------------------------ commit
    def commit(self, accepted_rows: torch.Tensor, num_accepted: torch.Tensor,
               n: int) -> None:
        """After the walk of a step with drafts: accepted_rows [N, L+1] (verify rows,
        0 first), num_accepted [N] by batch row, n = the batch's requests.  Every GDN
        layer's state and conv history advance along each request's path."""
        if self._seen == self.step_id and self._rows_map is not None:  # mixed batch
            sel = self._rows_map.to(accepted_rows.device)
            rows, num, m = accepted_rows[sel], num_accepted[sel], self._n
        else:  # speculative rows = the first batch rows (FULL graphs: always)
            rows, num, m = accepted_rows[:n], num_accepted[:n], n
        rows, num = rows.long(), num.long()
        if rows.is_cuda and use_triton(rows, self.backend) and \
                not torch.cuda.is_current_stream_capturing():
            self._commit_graphed(rows, num, m)
        else:
            self._commit_all(rows, num, m)

    def _commit_all(self, rows, num, n) -> None:
        for name, layer in self.layers.items():
            kv = layer.kv_cache
            conv = kv[0] if _dim_first() else kv[0].transpose(-1, -2)
            self._commit_layer(name, conv, kv[1], rows, num, n)

    def _commit_graphed(self, rows, num, n) -> None:
        """All layers' commits (two launches each) replayed from one CUDA graph per
        batch size: the commit runs after the walk, outside the step's graphs.  A
        batch size's first commit runs eagerly (compiling the kernels) and is then
        captured; the graphs read fixed buffers and are dropped when vLLM re-binds its
        caches."""
        l1 = rows.shape[1]
        key = tuple(t.data_ptr() for layer in self.layers.values() for t in layer.kv_cache)
        if self._graph_key != (l1, key):
            self._graph_key, self._graphs = (l1, key), {}
            self._rows_buf = torch.zeros(self.max_reqs, l1, dtype=torch.int64,
                                         device=rows.device)
            self._num_buf = torch.zeros(self.max_reqs, dtype=torch.int64, device=rows.device)
        self._rows_buf[:n].copy_(rows)
        self._num_buf[:n].copy_(num)
        g = self._graphs.get(n)
        if g is not None:
            g.replay()
            return
        self._commit_all(self._rows_buf[:n], self._num_buf[:n], n)
        g = torch.cuda.CUDAGraph()
        # recorded, not run; thread_local: other threads of the server (async output
        # copies) may use CUDA while this captures
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            self._commit_all(self._rows_buf[:n], self._num_buf[:n], n)
        self._graphs[n] = g

    def _commit_layer(self, name, conv_state, ssm_state, rows, num, n) -> None:
        buf, w = self.bufs[name], self.width
        qsl = self.qsl[:n]
        slots = self.slots[name][:n]
        if use_triton(ssm_state, self.backend):  # two launches, in place
            gdn_triton.commit(ssm_state, slots, (buf.k, buf.u, buf.G), qsl, rows, num,
                              state_kv=False)
            gdn_triton.conv_commit(conv_state, slots, buf.x, self.windows, qsl, rows, num)
            return
        j = torch.arange(rows.shape[1], device=rows.device)
        on = j[None, :] <= num[:, None]
        tok = torch.where(on, qsl[:, None] + rows.clamp(min=0), self.max_tokens)  # [N, J]
        stash = GDNStash(buf.k[tok], buf.u[tok], buf.G[tok])
        h0 = ssm_state[slots].transpose(-1, -2)
        state = tree_gdn_commit(h0, stash, j.expand(n, -1).contiguous(), num,
                                backend="torch")
        # conv: the last accepted row's window without its oldest entry
        last = qsl + rows.gather(1, num[:, None])[:, 0]
        idx = self.windows[last][:, 1:]  # [N, W-1] into [history, rows]
        hist = conv_state[slots, :, : w - 1]  # [N, C, W-1]
        from_row = idx >= w - 1
        xr = buf.x[torch.where(from_row, qsl[:, None] + idx - (w - 1), self.max_tokens)]
        hc = hist.gather(2, idx.clamp(max=w - 2)[:, None, :].expand(-1, hist.shape[1], -1))
        new = torch.where(from_row[:, None, :], xr.transpose(1, 2).to(hist.dtype), hc)
        ssm_state[slots] = state.transpose(-1, -2).to(ssm_state.dtype)
        conv_state[slots, :, : w - 1] = new


@dataclass
class _Plan:
    n: int
    t: int
    rows_map: torch.Tensor | None  # host: batch row of each spec row (mixed batches)
    index: torch.Tensor  # [N, T] token of each verify row (pads: the root)
    valid: torch.Tensor  # [N, T]
    mask: torch.Tensor  # [N, T, T] ancestor-or-self (pads: self only)
    windows: torch.Tensor  # [N, T, W]
    write: torch.Tensor  # [N * T] flat stash row of each verify row (pads: dump row)
    orow: torch.Tensor  # [N, T] output row of each verify row (pads: row ``tokens``)
    mask8: torch.Tensor  # mask as int8 (the kernels')
    srow: torch.Tensor  # write as [N, T]


def step_scope(md):
    """The object all GDN layers of one forward share: vLLM's forward context (a new
    one per forward and per graph capture), else (no context set: unit tests) the
    metadata."""
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available
    except ImportError:
        return md
    return get_forward_context() if is_forward_context_available() else md


def _dim_first() -> bool:
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return is_conv_state_dim_first()


def tree_spec_forward(layer, md, mixed_qkv_spec, b_spec, a_spec, conv_state, ssm_state):
    """The hook's entry point (qwen_gdn_linear_attn.py, _forward_core)."""
    gdn = getattr(layer, ATTR, None)
    if gdn is None:
        raise RuntimeError(
            "DDTree: a GDN layer ran a speculative step but the DDTree runtime did not "
            "attach its tree state to it (is the ddtree-gdn transform applied on both "
            "the layer and the runtime? run `ddtree-patch status`)")
    return gdn.forward(layer, md, mixed_qkv_spec, b_spec, a_spec, conv_state, ssm_state)


def gdn_layers(forward_context: dict) -> dict:
    """The GDN layers of a model (static_forward_context: prefix -> layer): instances
    of vLLM's GatedDeltaNetAttention (by class name: no vllm import needed)."""
    return {name: layer for name, layer in forward_context.items()
            if any(c.__name__ == "GatedDeltaNetAttention" for c in type(layer).__mro__)}


def attach(runner, tree_state, budget: int, depth: int):
    """The GDNTree of a model runner whose target has Qwen GDN layers (None without
    any), its buffers sized for the most speculative tokens one step can verify."""
    cc = getattr(runner, "compilation_config", None)
    layers = gdn_layers(getattr(cc, "static_forward_context", None) or {})
    if not layers:
        return None
    max_reqs = runner.max_num_reqs
    cap = runner.vllm_config.scheduler_config.max_num_batched_tokens
    gdn = GDNTree(layers, tree_state, min(max_reqs * (1 + budget), cap), max_reqs, depth,
                  runner.device)
    from .. import log

    log(__name__, "DDTree GDN: %d layers on the tree path, %.1f MiB of state per request "
        "(one slot; a chain of k drafts keeps 1 + k), step buffers %.1f MiB for %d "
        "speculative tokens", len(layers), state_bytes(layers) / 2**20,
        gdn.stash_bytes() / 2**20, gdn.max_tokens)
    return gdn


def state_bytes(layers: dict) -> int:
    """One request's recurrent state (conv + SSM) over these layers, one slot each."""
    total = 0
    for layer in layers.values():
        for shape, dt in zip(layer.get_state_shape(), layer.get_state_dtype()):
            n = 1
            for x in shape:
                n *= x
            total += n * dt.itemsize
    return total


def state_slots(num_spec: int, speculative_config) -> int:
    """The per-draft state slots a GDN layer keeps under DDTree (gdn/base.py hook):
    none on CUDA (this module's one-slot path), up to ddtree_depth on the CPU backend
    (payload gdn.py reads slot num_accepted - 1 there)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return min(num_spec, speculative_config.ddtree_depth)
    return 0
