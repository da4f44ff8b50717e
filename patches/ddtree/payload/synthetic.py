"""A drafter you can control: synthetic per-position distributions for tests and
benchmarks (in the spirit of vLLM's synthetic rejection sampling).

``speculative_config["ddtree_synthetic"]`` names a JSON file:
    {"sequences": [[prompt + greedy continuation token ids], ...],
     "rank_probs": [0.6, 0.3, 0.1],   # P(true token has rank 0, 1, 2, ...); rest: absent
     "seed": 0, "peak": 3.0}
For a request whose prompt starts one of the sequences, the drafter's log-probs at
depth d are replaced by a random distribution in which the sequence's true token at
that position sits at a rank drawn from ``rank_probs`` (or far down the list).
Other requests keep the real drafter's output.  Only drafts change, so the output
must stay exactly the target's: that is what the tests check.
"""

from __future__ import annotations

import json

import torch


class SyntheticDrafter:
    def __init__(self, sequences, rank_probs, seed=0, peak=3.0):
        self.sequences = [list(map(int, s)) for s in sequences]
        self.rank_probs = [float(p) for p in rank_probs]
        self.seed = int(seed)
        self.peak = float(peak)

    @classmethod
    def load(cls, path: str) -> "SyntheticDrafter":
        with open(path) as f:
            cfg = json.load(f)
        return cls(cfg["sequences"], cfg.get("rank_probs", [1.0]), cfg.get("seed", 0),
                   cfg.get("peak", 3.0))

    def _sequence(self, prompt) -> list[int] | None:
        prompt = list(prompt)
        for s in self.sequences:
            if s[: len(prompt)] == prompt:
                return s
        return None

    def _rank(self, g: torch.Generator) -> int:
        u = torch.rand(1, generator=g).item()
        acc = 0.0
        for r, p in enumerate(self.rank_probs):
            acc += p
            if u < acc:
                return r
        return -1  # absent

    def logits(self, runner, call: dict, n: int, depth: int, real: torch.Tensor):
        cad = call["common_attn_metadata"]
        seq_lens = cad.seq_lens[:n].cpu()
        rejected = call.get("num_rejected_tokens_gpu")
        rejected = rejected[:n].cpu() if rejected is not None else torch.zeros_like(seq_lens)
        out = real.clone()
        for i, rid in enumerate(runner.input_batch.req_ids[:n]):
            req = runner.requests.get(rid)
            if req is None:
                continue
            bonus_pos = int(seq_lens[i] - rejected[i])  # position of the bonus token
            rows = self.distributions(req.prompt_token_ids, bonus_pos, i, depth,
                                      real.shape[-1])
            if rows is not None:
                out[i] = rows.to(out.dtype)
        return out

    def distributions(self, prompt, bonus_pos: int, i: int, depth: int, vocab: int):
        """[depth, vocab] synthetic logits of the request in batch row i whose bonus
        token sits at bonus_pos, or None when its prompt starts no profile sequence."""
        seq = self._sequence(prompt)
        if seq is None:
            return None
        out = torch.empty(depth, vocab)
        for d in range(1, depth + 1):
            p = bonus_pos + d
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + p * 131 + i)
            base = torch.randn(vocab, generator=g) * self.peak
            if p < len(seq):
                true = seq[p]
                order = torch.argsort(base, descending=True)
                r = self._rank(g)
                # move the true token to rank r (or to the bottom when absent)
                target = order[r] if r >= 0 else order[-1]
                base[true], base[target] = base[target].clone(), base[true].clone()
            out[d - 1] = base
        return out
