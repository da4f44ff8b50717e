#!/usr/bin/env python3
"""Train the real pair from scratch: corpus -> tokenizer -> Qwen3 target -> the
target's greedy continuations -> DFlash drafter -> offline acceptance.

    python bench/realpair/train.py OUT [--tiny | --preset cpu] [--target-seconds S]
        [--drafter-seconds S] [--target-from EARLIER_OUT] [--set KEY=JSON ...]

Writes OUT/pair/target (save_pretrained + tokenizer), OUT/pair/drafter (the layout
vLLM's qwen3_dflash loads), OUT/pair/prompts.json (held-out prompts for measure.py),
OUT/corpus.json (the file list) and OUT/train.json (recipe, losses, acceptance).
Training budgets are wall-clock seconds (the step counts are recorded), so the run
always fits its slot; everything else is seeded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accept  # noqa: E402
import corpus  # noqa: E402
import pair  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

PRESETS = {
    # H200: ~19M non-embedding params, 4 x 8192 vocab rows; 2-layer drafter, block 16
    "gpu": dict(vocab=8192, hidden=512, inter=1536, layers=6, heads=8, kv_heads=4,
                head_dim=64, seq=512, batch=48, lr=2e-3,
                d_layers=2, d_aux=3, block=16, d_batch=48, d_blocks=16, d_lr=1.5e-3,
                gen_batch=768, gen_prompt=(64, 192), gen_len=256, gen_max_seqs=12288,
                eval_prompts=64, eval_prompt_len=128, eval_gen=160, eval_stride=4,
                eval_max_anchors=1024, measure_prompts=16, measure_max_tokens=128,
                b1_prompts=8, max_files=None, tok_bytes=12_000_000,
                budgets=(16, 32, 64, 128, 256), d_init="random"),
    # a long CPU run (about an hour on 2 cores, #31): vocab 2048, 4 x 192 target, a
    # 2-layer drafter at block 16; budgets are wall clock (--*-seconds)
    "cpu": dict(vocab=2048, hidden=192, inter=512, layers=4, heads=3, kv_heads=1,
                head_dim=64, seq=256, batch=16, lr=3e-3,
                d_layers=2, d_aux=2, block=16, d_batch=16, d_blocks=8, d_lr=2e-3,
                gen_batch=256, gen_prompt=(48, 96), gen_len=128, gen_max_seqs=24576,
                eval_prompts=48, eval_prompt_len=64, eval_gen=160, eval_stride=4,
                eval_max_anchors=768, measure_prompts=8, measure_max_tokens=128,
                b1_prompts=4, max_files=None, tok_bytes=4_000_000,
                budgets=(8, 16, 32, 64, 128, 256), d_init="random"),
    # CPU smoke run of the whole pipeline (minutes on 2 cores)
    "tiny": dict(vocab=1024, hidden=128, inter=256, layers=4, heads=2, kv_heads=1,
                 head_dim=64, seq=128, batch=8, lr=3e-3,
                 d_layers=1, d_aux=2, block=8, d_batch=8, d_blocks=4, d_lr=3e-3,
                 gen_batch=32, gen_prompt=(24, 40), gen_len=56, gen_max_seqs=96,
                 eval_prompts=8, eval_prompt_len=32, eval_gen=48, eval_stride=4,
                 eval_max_anchors=64, measure_prompts=4, measure_max_tokens=24,
                 b1_prompts=4, max_files=160, tok_bytes=1_500_000, budgets=(8, 16, 32),
                 d_init="random"),
}


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


class Clock:
    def __init__(self):
        self.t0 = time.perf_counter()
        self.stages = {}

    def stage(self, name, t):
        self.stages[name] = round(time.perf_counter() - t, 2)
        log(f"[{name}] {self.stages[name]} s")


def lr_at(frac: float, warm: float = 0.04, floor: float = 0.1) -> float:
    if frac < warm:
        return frac / warm
    x = min(1.0, (frac - warm) / (1 - warm))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * x))


def progress(t0, seconds, step, max_steps) -> float:
    """Training progress in [0, 1]: wall clock, or the step cap if it comes first."""
    frac = (time.perf_counter() - t0) / seconds
    return max(frac, step / max_steps) if max_steps else frac


def schedule(opt, base_lr, seconds, max_steps):
    """Yields (step, progress) until the wall-clock budget or the step cap is spent,
    setting every step's learning rate (warm-up, cosine by progress)."""
    t0, step = time.perf_counter(), 0
    while (frac := progress(t0, seconds, step, max_steps)) < 1.0:
        for gr in opt.param_groups:
            gr["lr"] = base_lr * lr_at(frac)
        yield step, frac
        step += 1


def update(opt, loss, params, ema):
    """One optimizer step (grad-norm clip 1.0); returns the loss's running mean, kept
    on the device (no host sync per step: the CPU keeps queueing kernels ahead)."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    lv = loss.detach().float()
    return lv if ema is None else 0.98 * ema + 0.02 * lv


def autocast(dev):
    if dev.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


# ------------------------------------------------------------------ target

@torch.no_grad()
def heldout_loss(model, stream, seq, dev, max_windows=128):
    n = min(max_windows, (len(stream) - 1) // seq)
    if n == 0:
        return None
    tot, cnt = 0.0, 0
    model.eval()
    for i in range(0, n, 32):
        rows = torch.stack([stream[j * seq: j * seq + seq + 1]
                            for j in range(i, min(n, i + 32))]).long().to(dev)
        with autocast(dev):
            logits = model(input_ids=rows[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               rows[:, 1:].reshape(-1), reduction="sum")
        tot += float(loss)
        cnt += rows[:, 1:].numel()
    model.train()
    return tot / cnt


def train_target(model, train_stream, held_stream, p, seconds, dev, seed, res,
                 max_steps=None):
    seq, bs = p["seq"], p["batch"]
    g = torch.Generator().manual_seed(seed)
    decay = [q for n, q in model.named_parameters() if q.dim() >= 2 and "embed" not in n]
    other = [q for n, q in model.named_parameters() if not (q.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}],
                            lr=p["lr"], betas=(0.9, 0.95), eps=1e-8,
                            fused=dev.type == "cuda")
    stream = train_stream.to(dev)
    n_start = len(stream) - seq - 1
    model.train()
    t0 = time.perf_counter()
    step, curve, ema = 0, [], None
    best = (float("inf"), None, 0)
    next_eval = 0.0
    for step, frac in schedule(opt, p["lr"], seconds, max_steps):
        starts = torch.randint(0, n_start, (bs,), generator=g).to(dev)
        idx = starts[:, None] + torch.arange(seq + 1, device=dev)
        rows = stream[idx].long()
        with autocast(dev):
            logits = model(input_ids=rows[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               rows[:, 1:].reshape(-1))
        ema = update(opt, loss, model.parameters(), ema)
        step += 1
        if frac >= next_eval:  # held-out loss ~10 times per run; keep the best
            hl = heldout_loss(model, held_stream, seq, dev, max_windows=64)
            curve.append({"s": round(time.perf_counter() - t0, 1), "step": step,
                          "train_loss": round(float(ema), 4), "heldout_loss": round(hl, 4)})
            log("target", curve[-1])
            if hl < best[0]:
                best = (hl, {k: v.detach().clone() for k, v in model.state_dict().items()},
                        step)
            next_eval += 0.1
    hl = heldout_loss(model, held_stream, seq, dev, max_windows=64)
    if hl > best[0]:
        model.load_state_dict(best[1])
        log(f"target: kept step {best[2]} (held-out {best[0]:.4f} < final {hl:.4f})")
    dt = time.perf_counter() - t0
    res["target_train"] = {"steps": step, "seconds": round(dt, 1),
                           "tokens": step * bs * seq,
                           "tokens_per_s": round(step * bs * seq / dt),
                           "kept_step": best[2] if hl > best[0] else step,
                           "curve": curve}


def load_target(tdir: Path, dev):
    """A target saved by save_target: (model on dev, its target_params)."""
    from transformers import Qwen3ForCausalLM

    tp = json.load(open(tdir / "tiny_model.json"))["params"]
    return Qwen3ForCausalLM.from_pretrained(str(tdir)).to(dev), tp


# ------------------------------------------------------------------ generation

@torch.no_grad()
def greedy(model, prompts: torch.Tensor, n_new: int, dev, temperature: float = 0.0,
           seed: int = 0) -> torch.Tensor:
    """prompts [B, P] -> [B, P + n_new]: greedy, or sampled at ``temperature`` > 0 from
    a seeded generator (KV cache, bf16 autocast on CUDA)."""
    model.eval()
    x = prompts.to(dev).long()
    g = torch.Generator(device=dev).manual_seed(seed) if temperature > 0 else None

    def pick(logits):
        if g is None:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / temperature, -1)
        return torch.multinomial(probs, 1, generator=g).squeeze(-1)

    with autocast(dev):
        out = model(input_ids=x, use_cache=True, logits_to_keep=1)
        past = out.past_key_values
        nxt = pick(out.logits[:, -1])
        toks = [nxt]
        for _ in range(n_new - 1):
            out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = pick(out.logits[:, -1])
            toks.append(nxt)
    return torch.cat([x, torch.stack(toks, 1)], 1)


def windows(stream, starts, n, length, seed, min_tail=0):
    """n windows of `length` tokens from distinct documents (seeded), never
    crossing a document end; documents too short are skipped."""
    rng = random.Random(seed)
    ends = list(starts[1:]) + [len(stream)]
    docs = [(s, e - 1) for s, e in zip(starts, ends) if e - 1 - s >= length + min_tail]
    rng.shuffle(docs)
    out = []
    for i in range(n):
        s, e = docs[i % len(docs)]
        off = rng.randrange(s, e - length - min_tail + 1)
        out.append(stream[off: off + length])
    return torch.stack(out).long()


def generate_data(model, train_stream, p, seconds, dev, seed):
    """Batches of (prompt from the train split, greedy continuation)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    data, n = [], 0
    while n < p["gen_max_seqs"] and (not data or time.perf_counter() - t0 < seconds):
        pl = rng.randint(*p["gen_prompt"])
        starts = torch.randint(0, len(train_stream) - pl, (p["gen_batch"],), generator=g)
        prompts = torch.stack([train_stream[s: s + pl] for s in starts.tolist()]).long()
        data.append((greedy(model, prompts, p["gen_len"], dev), pl))
        n += p["gen_batch"]
    return data, time.perf_counter() - t0


# ------------------------------------------------------------------ drafter

def sample_anchors(n, lo, hi, k, g):
    """[n, k] distinct anchors per row from [lo, hi]."""
    span = hi - lo + 1
    k = min(k, span)
    r = torch.rand(n, span, generator=g)
    return r.topk(k, dim=1).indices.sort(dim=1).values + lo


def drafter_loss(drafter, target, cap, x, anchors, block, mask_id, weights):
    with torch.no_grad():
        target.model(input_ids=x)
        aux = cap.take()
        ids, qpos, labels = pair.block_inputs(x, anchors, block, mask_id)
        emb = target.model.embed_tokens(ids)
    h = drafter(aux, emb, qpos, anchors, block)
    N, nb = anchors.shape
    h = h.view(N, nb, block, -1)[:, :, 1:]
    logits = target.lm_head(h).float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                         reduction="none").view(N, nb, block - 1)
    return (ce * weights).sum(-1).mean() / weights.sum(), logits, labels


def init_from_target(drafter, target) -> None:
    """Copy the target's last len(drafter.layers) decoder layers into the drafter's
    layers (a Qwen3 layer's parameter names and shapes are the drafter layer's)."""
    src = target.model.layers[-len(drafter.layers):]
    for d, t in zip(drafter.layers, src):
        d.load_state_dict({k: v.detach().float() for k, v in t.state_dict().items()
                           if not k.startswith("self_attn.rotary")}, strict=True)


def train_drafter(drafter, target, cap, data, p, seconds, dev, seed, mask_id, res,
                  max_steps=None):
    block = p["block"]
    gamma = {16: 7.0, 10: 5.0, 8: 4.0}.get(block, block / 2)  # DFlash's loss decay
    weights = torch.exp(-torch.arange(block - 1, device=dev, dtype=torch.float32) / gamma)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(drafter.parameters(), lr=p["d_lr"], betas=(0.9, 0.95),
                            weight_decay=0.01, fused=dev.type == "cuda")
    t0 = time.perf_counter()
    step, curve, ema = 0, [], None
    next_log = 0.0
    drafter.train()
    for step, frac in schedule(opt, p["d_lr"], seconds, max_steps):
        toks, pl = data[int(torch.randint(0, len(data), (1,), generator=g))]
        rows = torch.randint(0, toks.shape[0], (p["d_batch"],), generator=g).to(toks.device)
        x = toks[rows]
        anchors = sample_anchors(x.shape[0], pl, x.shape[1] - block, p["d_blocks"],
                                 g).to(dev)
        with autocast(dev):
            loss, logits, labels = drafter_loss(drafter, target, cap, x, anchors, block,
                                                mask_id, weights)
        ema = update(opt, loss, drafter.parameters(), ema)
        step += 1
        if frac >= next_log:
            acc = (logits.argmax(-1) == labels).float().mean((0, 1))
            curve.append({"s": round(time.perf_counter() - t0, 1), "step": step,
                          "loss": round(float(ema), 4),
                          "top1_d1": round(float(acc[0]), 3),
                          "top1_last": round(float(acc[-1]), 3)})
            log("drafter", curve[-1])
            next_log += 0.1
    dt = time.perf_counter() - t0
    res["drafter_train"] = {"steps": step, "seconds": round(dt, 1), "curve": curve,
                            "blocks_per_s": round(step * p["d_batch"] * p["d_blocks"] / dt),
                            "loss_decay_gamma": gamma}


@torch.no_grad()
def drafter_logprobs(drafter, target, cap, x, anchors, p, dev, mask_id):
    """log-probs [N * nb, block-1, V] and truths at the given anchors [N, nb]."""
    block = p["block"]
    with autocast(dev):
        _, logits, labels = drafter_loss(drafter, target, cap, x, anchors, block,
                                         mask_id, torch.ones(block - 1, device=dev))
    v = logits.shape[-1]
    return (logits.float().log_softmax(-1).reshape(-1, block - 1, v),
            labels.reshape(-1, block - 1))


@torch.no_grad()
def evaluate(drafter, target, cap, seqs, prompt_len, p, dev, mask_id):
    """Offline acceptance on held-out greedy continuations: over anchors spread along
    every continuation, and along the decodes measure.py runs (the first
    measure_prompts prompts, measure_max_tokens tokens; accept.trajectory_tau)."""
    drafter.eval()
    block, budgets = p["block"], p["budgets"]
    lo, hi = prompt_len, seqs.shape[1] - block
    spread = list(range(lo, hi + 1, p["eval_stride"]))
    per_seq = max(1, min(len(spread), p["eval_max_anchors"] // seqs.shape[0]))
    spread = spread[:: max(1, len(spread) // per_seq)][:per_seq]
    parts = []
    for i in range(0, seqs.shape[0], 16):
        x = seqs[i: i + 16].to(dev)
        anchors = torch.tensor(spread, device=dev).expand(x.shape[0], -1).contiguous()
        parts.append(accept.per_anchor(*drafter_logprobs(drafter, target, cap, x, anchors,
                                                         p, dev, mask_id), budgets))
    res = accept.summarize(accept.merge(parts), budgets)
    m, mt = p["measure_prompts"], p["measure_max_tokens"]
    if seqs.shape[1] - prompt_len < mt + block - 1:
        raise ValueError("eval_gen must cover measure_max_tokens + block - 1")
    traj = []
    for i in range(m):
        x = seqs[i: i + 1].to(dev)
        anchors = torch.arange(prompt_len, prompt_len + mt, device=dev).unsqueeze(0)
        traj.append(accept.per_anchor(*drafter_logprobs(drafter, target, cap, x, anchors,
                                                        p, dev, mask_id), budgets))
    res["trajectory"] = {"prompts": m, "max_tokens": mt,
                         **accept.trajectory_tau(traj, mt, budgets)}
    b1 = p["b1_prompts"]
    res["trajectory_b1"] = {"prompts": b1, "max_tokens": mt,
                            **accept.trajectory_tau(traj[:b1], mt, budgets)}
    return res


def distinct_ngrams(seqs: torch.Tensor, start: int, n: int = 4) -> float:
    """Share of distinct n-grams in the generated part (1.0: no repetition)."""
    tot = dist = 0
    for row in seqs[:, start:].tolist():
        grams = [tuple(row[i: i + n]) for i in range(len(row) - n + 1)]
        tot += len(grams)
        dist += len(set(grams))
    return dist / max(1, tot)


# ------------------------------------------------------------------ main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke sizes (--preset tiny)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="gpu (default), cpu (a long CPU run), tiny (smoke)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-seconds", type=float, default=None)
    ap.add_argument("--gen-seconds", type=float, default=None)
    ap.add_argument("--drafter-seconds", type=float, default=None)
    ap.add_argument("--target-steps", type=int, default=None,
                    help="stop the target at this many steps if the time lasts "
                         "(--tiny: 150, so CPU runs are deterministic)")
    ap.add_argument("--drafter-steps", type=int, default=None, help="(--tiny: 400)")
    ap.add_argument("--corpus", choices=("stdlib", "stdlib+site"), default=None,
                    help="the standard library's .py files, plus an even spread of the "
                         "interpreter's site-packages .py files up to --site-mb MB "
                         "(default: stdlib+site on the GPU preset, stdlib with --tiny)")
    ap.add_argument("--site-mb", type=float, default=40.0)
    ap.add_argument("--heldout-frac", type=float, default=0.05)
    ap.add_argument("--target-from", default=None, metavar="DIR",
                    help="reuse the target (and tokenizer) of an earlier run's OUT "
                         "instead of training one: several drafters for one target, or "
                         "a drafter trained in a later call than its target")
    ap.add_argument("--eval-only", action="store_true",
                    help="OUT already holds a trained pair (a run cut in its evaluation): "
                         "load its target and drafter and run only the held-out "
                         "evaluation (train.json, prompts.json)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override a preset value, e.g. --set layers=8")
    args = ap.parse_args(argv)
    if args.eval_only:
        if not (Path(args.out) / "pair" / "drafter" / "model.safetensors").exists():
            ap.error(f"--eval-only: no trained drafter in {args.out}/pair/drafter")
        args.target_from = args.out
    if args.target_from and not all((Path(args.target_from) / f).exists() for f in (
            "corpus.json", "pair/target/config.json", "pair/target/tiny_model.json")):
        ap.error(f"--target-from {args.target_from}: no saved target there "
                 "(corpus.json, pair/target/)")
    preset = args.preset or ("tiny" if args.tiny else "gpu")
    args.tiny = preset == "tiny"
    p = dict(PRESETS[preset])
    for kv in args.set:
        k, v = kv.split("=", 1)
        if k not in p:
            ap.error(f"unknown preset key {k}")
        p[k] = json.loads(v)
    secs = {"target": args.target_seconds or (60 if args.tiny else 120),
            "gen": args.gen_seconds or (5 if args.tiny else 20),
            "drafter": args.drafter_seconds or (60 if args.tiny else 80)}
    steps = {"target": args.target_steps or (150 if args.tiny else None),
             "drafter": args.drafter_steps or (400 if args.tiny else None)}

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(args.out)
    pdir = out / "pair"
    tdir, ddir = pdir / "target", pdir / "drafter"
    tdir.mkdir(parents=True, exist_ok=True)
    clock = Clock()
    res = {"preset": preset, "params": p, "seconds": secs,
           "max_steps": steps,
           "seed": args.seed, "device": str(dev), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None}
    try:
        import transformers

        res["transformers"] = transformers.__version__
    except ImportError:
        pass

    # corpus + tokenizer
    t = time.perf_counter()
    site = (args.corpus or ("stdlib+site" if preset == "gpu" else "stdlib")) == "stdlib+site"
    texts, files = corpus.load_corpus(site, args.heldout_frac, args.seed, 400_000,
                                      p["max_files"], int(args.site_mb * 1e6))
    record = corpus.corpus_record(files, site, args.seed, args.heldout_frac)
    if args.target_from and json.load(open(Path(args.target_from) / "corpus.json")) != \
            json.loads(json.dumps(record)):
        raise SystemExit("--target-from: that run's corpus (files, split, seed) differs "
                         "from this one's: its held-out prompts would not be held out")
    corpus.dump(out / "corpus.json", record)
    src = Path(args.target_from) / "pair" / "target" if args.target_from else None
    if src is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    else:
        tok = corpus.train_tokenizer(texts["train"], p["vocab"], p["tok_bytes"], args.seed)
    corpus.save_tokenizer(tok, tdir)
    train_stream, _ = corpus.encode_stream(tok, texts["train"])
    held_stream, held_starts = corpus.encode_stream(tok, texts["heldout"])
    n_tok = tok.get_vocab_size()
    vocab = -(-n_tok // 128) * 128  # rows padded to a multiple of 128 (never emitted)
    res["corpus"] = {"files": len(files),
                     "train_files": len(texts["train"]), "heldout_files": len(texts["heldout"]),
                     "train_tokens": len(train_stream), "heldout_tokens": len(held_stream),
                     "tokenizer_vocab": n_tok, "model_vocab": vocab,
                     "bytes_per_token": round(sum(map(len, texts["train"])) /
                                              max(1, len(train_stream)), 3)}
    log("corpus", res["corpus"])
    clock.stage("corpus_tokenizer", t)

    # target
    t = time.perf_counter()
    if src is not None:  # an earlier run's target: its recipe and curve come along
        target, tp = load_target(src, dev)
        res["target_reused_from"] = str(src)
        prev_file = Path(args.target_from) / "train.json"  # absent if that run was cut
        prev = json.load(open(prev_file)) if prev_file.exists() else {}
        if args.eval_only:  # the run's own record (written before its evaluation)
            for k in ("distill_data", "drafter_train", "drafter", "params", "seconds"):
                if k in prev:
                    res[k] = prev[k]
            p.update(res.get("params", {}))  # that run's recipe, then this call's --set
            p.update({k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.set)})
            res["params"] = p
        res["target_train"] = prev.get("target_train")  # None: that run was cut
        res["target_params_count"] = sum(q.numel() for q in target.parameters())
    else:
        tp = pair.target_params(seed=args.seed, vocab_size=vocab, hidden_size=p["hidden"],
                                intermediate_size=p["inter"], num_hidden_layers=p["layers"],
                                num_attention_heads=p["heads"],
                                num_key_value_heads=p["kv_heads"], head_dim=p["head_dim"],
                                max_position_embeddings=2048, rope_theta=10000.0,
                                mask_token_id=corpus.SPECIALS.index(corpus.MASK),
                                bos_token_id=0, eos_token_id=1)
        target = pair.make_target(tp).to(dev)
        res["target_params_count"] = sum(q.numel() for q in target.parameters())
        train_target(target, train_stream, held_stream, p, secs["target"], dev, args.seed,
                     res, steps["target"])
    mask_id = tp["mask_token_id"]
    hl = heldout_loss(target, held_stream, p["seq"], dev, max_windows=256)
    res["target_heldout"] = {"loss": round(hl, 4), "ppl": round(math.exp(hl), 3),
                             "bits_per_byte": round(hl / math.log(2) /
                                                    res["corpus"]["bytes_per_token"], 4)}
    log("target held-out", res["target_heldout"])
    target.float()
    if not args.eval_only:
        pair.save_target(target, tp, tdir, mask_id)
    clock.stage("target", t)
    if args.eval_only:
        drafter, dcfg_saved = pair.load_drafter(ddir, dev)
        layer_ids = dcfg_saved["dflash_config"]["target_layer_ids"]
        cap = pair.AuxCapture(target, layer_ids)
        return evaluate_and_save(res, p, args, drafter, target, cap, held_stream,
                                 held_starts, mask_id, tok, pdir, out, clock, dev)

    # the target's greedy continuations of train prompts
    t = time.perf_counter()
    for q in target.parameters():
        q.requires_grad_(False)
    data, gdt = generate_data(target, train_stream, p, secs["gen"], dev, args.seed + 1)
    n_seq = sum(d[0].shape[0] for d in data)
    res["distill_data"] = {"sequences": n_seq, "gen_len": p["gen_len"],
                           "tokens": n_seq * p["gen_len"], "seconds": round(gdt, 1),
                           "distinct_4grams": round(distinct_ngrams(
                               data[0][0][:64].cpu(), data[0][1]), 4)}
    log("distillation data", res["distill_data"])
    clock.stage("generate", t)

    # drafter
    t = time.perf_counter()
    layer_ids = pair.default_layer_ids(target.config.num_hidden_layers, p["d_aux"])
    tcfg = json.load(open(tdir / "config.json"))
    dcfg = pair.drafter_config(tcfg, p["d_layers"])
    drafter = pair.Drafter(dcfg, len(layer_ids))
    drafter.init_weights(args.seed + 2)
    if p["d_init"] == "target":  # start from the target's last layers (same names)
        init_from_target(drafter, target)
    elif p["d_init"] != "random":
        raise SystemExit(f"d_init: random or target, not {p['d_init']!r}")
    drafter.to(dev)
    cap = pair.AuxCapture(target, layer_ids)
    train_drafter(drafter, target, cap, data, p, secs["drafter"], dev, args.seed + 3,
                  mask_id, res, steps["drafter"])
    del data
    pair.save_drafter(drafter, ddir, tdir, layer_ids=layer_ids, block_size=p["block"],
                      mask_token_id=mask_id)
    res["drafter"] = {"layers": p["d_layers"], "target_layer_ids": layer_ids,
                      "block_size": p["block"],
                      "params": sum(q.numel() for q in drafter.parameters())}
    clock.stage("drafter", t)

    corpus.dump(out / "train.json", res)  # the record so far (--eval-only reads it)
    return evaluate_and_save(res, p, args, drafter, target, cap, held_stream, held_starts,
                             mask_id, tok, pdir, out, clock, dev)


def evaluate_and_save(res, p, args, drafter, target, cap, held_stream, held_starts,
                      mask_id, tok, pdir, out, clock, dev) -> int:
    """Held-out prompts, the target's continuations (T = 0 and T = 1), offline
    acceptance; writes train.json and pair/prompts.json."""
    # held-out prompts: the target's greedy continuation, offline acceptance
    t = time.perf_counter()
    prompts = windows(held_stream, held_starts, p["eval_prompts"], p["eval_prompt_len"],
                      args.seed + 4)
    seqs = greedy(target, prompts, p["eval_gen"], dev).cpu()
    res["heldout_continuations"] = {
        "distinct_4grams": round(distinct_ngrams(seqs, p["eval_prompt_len"]), 4)}
    res["offline_acceptance"] = evaluate(drafter, target, cap, seqs, p["eval_prompt_len"],
                                         p, dev, mask_id)
    # T = 1: a sampled continuation is what a tree walk at T = 1 verifies against (each
    # node's target sample must be a child), so the same acceptance on target samples
    try:
        seqs1 = greedy(target, prompts, p["eval_gen"], dev, temperature=1.0,
                       seed=args.seed + 5).cpu()
        res["offline_acceptance_t1"] = evaluate(drafter, target, cap, seqs1,
                                                p["eval_prompt_len"], p, dev, mask_id)
        log("offline acceptance at T = 1: chain tau",
            round(res["offline_acceptance_t1"]["chain_tau"], 3))
    except Exception as e:  # noqa: BLE001 - the T = 0 results must still be written
        res["offline_acceptance_t1"] = {"error": repr(e)}
        log("offline acceptance at T = 1 failed:", repr(e))
    cap.remove()
    oa = res["offline_acceptance"]
    log("offline acceptance: chain tau", round(oa["chain_tau"], 3), "tree tau",
        {b: round(v["tau"], 3) for b, v in oa["tree"].items()})
    log("top-1 per depth", oa["top1_per_depth"])
    for key, job in (("trajectory_b1", "b1_t0"), ("trajectory", "bN_t0")):
        log(f"{key} tau (what measure.py's {job} should show):",
            {k: round(v["tau"], 3) for k, v in oa[key].items() if isinstance(v, dict)})
    m = p["measure_prompts"]
    corpus.dump(pdir / "prompts.json", {
        "prompts": prompts[:m].tolist(), "hf_greedy": seqs[:m, p["eval_prompt_len"]:].tolist(),
        "prompt_len": p["eval_prompt_len"], "max_tokens": p["measure_max_tokens"],
        "b1_prompts": p["b1_prompts"],
        "source": "held-out files, seeded windows",
        "text": [tok.decode(r) for r in prompts[:m, -48:].tolist()]})
    clock.stage("evaluate", t)
    res["stages_s"] = clock.stages
    res["total_s"] = round(time.perf_counter() - clock.t0, 1)
    corpus.dump(out / "train.json", res)
    log("done", res["total_s"], "s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
