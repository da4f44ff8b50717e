"""Per-node request semantics of the tree walk (V1 runner).

Every verify row gets the logits vLLM's no-spec sampler would sample from after that
row's own path: its "previous tokens" are the request's output so far plus the draft
tokens from the root down to the row's node.  In the order of vllm/v1/sample/
sampler.py (Sampler.apply_logits_processors): allowed_token_ids, bad_words, min_tokens
(stop tokens masked while the path is shorter than min_tokens), logit_bias, then the
presence / frequency / repetition penalties (vLLM's own ops, over the path's
tokens).  min_p follows temperature in core.sampling.target_probs, as in the sampler.
The walk stays lossless against these distributions: each visited row is the no-spec
distribution after the path that reached it.

Logprobs (``logprobs=N``) of the emitted tokens come from the verify rows they were
sampled at, raw (the default ``logprobs_mode``: vLLM's no-spec sampler and its
rejection sampler also return the unprocessed logits' logprobs).  vLLM's sampler
helpers are imported where they are used (the fast tier's stand-in vLLM has none).
"""

from __future__ import annotations

import torch


def _penalised(p) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


def processed(p) -> bool:
    """Does a request with these SamplingParams need its rows processed?"""
    return bool(p is not None and (_penalised(p) or p.allowed_token_ids or p.logit_bias
                                   or p.bad_words_token_ids or p.min_tokens))


def batch_requests(runner, n: int) -> list:
    """(SamplingParams, output token ids) of the request in each of the first n batch
    rows of a V1 runner, None where there is none: rows past the batch's requests, e.g.
    all n of the CUDA runner's profile run (_dummy_sampler_run)."""
    out = []
    for rid in runner.input_batch.req_ids[:n]:
        req = runner.requests.get(rid)
        params = getattr(req, "sampling_params", None)
        out.append(None if params is None else (params, req.output_token_ids))
    return out + [None] * (n - len(out))


def node_paths(tree, i: int, rows: int) -> list[list[int]]:
    """Draft tokens from the root to each verify row of request ``i`` (row 0: the root,
    row 1 + j: node j; rows past its nodes repeat its last path, they are never read)."""
    d = int(tree.num_nodes[i])
    toks = tree.tokens[i, :d].tolist()
    pars = tree.parents[i, :d].tolist()
    paths = [[]]
    for j in range(d):
        paths.append(paths[pars[j] + 1] + [toks[j]])
    return paths + [paths[-1]] * (rows - len(paths))


def process_rows(rows: torch.Tensor, tree, reqs, prompt_ids) -> torch.Tensor:
    """rows [n, R, V] target logits per verify row; reqs[i]: (SamplingParams, output
    token ids) of batch row i (None: no request); prompt_ids: vLLM's padded prompt
    tensor (SamplingMetadata.prompt_token_ids, set whenever a request has penalties).
    Returns ``rows`` itself when no request has such features, else a float32 copy
    with those requests' rows processed."""
    n, r, _ = rows.shape
    need = [i for i in range(n) if reqs[i] is not None and processed(reqs[i][0])]
    if not need:
        return rows
    out = rows.to(torch.float32, copy=True)
    hist = {i: [list(reqs[i][1]) + path for path in node_paths(tree, i, r)] for i in need}
    for i in need:
        _mask_and_bias(out[i], reqs[i][0], hist[i])
    pen = [i for i in need if _penalised(reqs[i][0])]
    if pen:
        _penalise(out, pen, [reqs[i][0] for i in pen], [hist[i] for i in pen], prompt_ids)
    return out


def _mask_and_bias(x: torch.Tensor, p, hist: list[list[int]]) -> None:
    """One request's rows x [R, V], in place: allowed_token_ids, bad_words (prefixes
    matched against each row's history), min_tokens, logit_bias."""
    from vllm.v1.sample.ops.bad_words import _apply_bad_words_single_batch

    if p.allowed_token_ids:
        banned = torch.ones(x.shape[1], dtype=torch.bool, device=x.device)
        banned[p.allowed_token_ids] = False
        x.masked_fill_(banned, float("-inf"))
    if p.bad_words_token_ids:
        for k, past in enumerate(hist):
            _apply_bad_words_single_batch(x[k], p.bad_words_token_ids, past)
    if p.min_tokens and p.all_stop_token_ids:
        short = [k for k, past in enumerate(hist) if len(past) < p.min_tokens]
        if short:
            stops = torch.tensor(sorted(p.all_stop_token_ids), device=x.device)
            x[torch.tensor(short, device=x.device)[:, None], stops[None, :]] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=x.device)
        x[:, ids] += torch.tensor(list(p.logit_bias.values()), dtype=torch.float32,
                                  device=x.device)


def _penalise(out: torch.Tensor, pen: list[int], params, hists, prompt_ids) -> None:
    """Presence / frequency / repetition penalties of batch rows ``pen`` (vLLM's own
    op), every verify row counting its own history."""
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    r, v = out.shape[1:]
    idx = torch.tensor(pen, device=out.device)

    def per_row(name):
        return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32,
                            device=out.device).repeat_interleave(r)

    x = apply_all_penalties(out[idx].view(len(pen) * r, v),
                            prompt_ids[idx].repeat_interleave(r, 0),
                            per_row("presence_penalty"), per_row("frequency_penalty"),
                            per_row("repetition_penalty"), [h for hs in hists for h in hs])
    out[idx] = x.view(len(pen), r, v)


def min_p_of(reqs, n: int, device) -> torch.Tensor | None:
    """[n] min_p per batch row, None when no request sets it."""
    vals = [float(reqs[i][0].min_p) if reqs[i] is not None else 0.0 for i in range(n)]
    return torch.tensor(vals, device=device) if any(vals) else None


def emitted_logprobs(sampler, rows: torch.Tensor, walk, tokens: torch.Tensor, k: int):
    """vLLM's LogprobsTensors for the sampler output ``tokens`` [n, W] (-1 padded):
    entry (i, j) from the verify row that emitted token j of request i (the walk's
    accepted rows), raw logprobs (or raw logits, logprobs_mode='raw_logits'), the
    emitted token first, then the top k."""
    n, w = tokens.shape
    acc = walk.emitting_rows(w)
    picked = rows[torch.arange(n, device=rows.device)[:, None], acc].reshape(n * w, -1)
    picked = picked.to(torch.float32)
    if sampler.logprobs_mode != "raw_logits":
        picked = sampler.compute_logprobs(picked)
    ids = tokens.reshape(-1).to(torch.int64).clamp(min=0)
    return sampler.gather_logprobs(picked, k, ids)
