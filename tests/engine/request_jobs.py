"""Request features DDTree serves per tree node on the V1 runner (issue #32): the
engine_runner jobs that exercise them (tests/engine/test_ddtree_engine.py) and the
comparisons against no-spec.

Each greedy feature job must change the no-spec output (else equality proves nothing)
and DDTree must give it token for token; sampled jobs compare distributions."""

from __future__ import annotations

GREEDY = {"temperature": 0.0, "max_tokens": 32, "ignore_eos": True}

# default target (vocab 512): greedy jobs, each on prompts of its own
FEATURES = {
    "logprobs": {"logprobs": 3},
    "penalties": {"presence_penalty": 1.5, "frequency_penalty": 0.5,
                  "repetition_penalty": 1.3},
    "allowed": {"allowed_token_ids": list(range(2, 200))},
    "logit_bias": {"logit_bias": {**{t: 30.0 for t in range(100, 140)},
                                  **{t: -100.0 for t in range(200, 260)}}},
}

# the small target (vocab 10): a path token is often the next token's best candidate,
# so a penalty that does not count the node's own path changes the output
PENALTIES = {
    "presence": {"presence_penalty": 2.0},
    "frequency": {"frequency_penalty": 2.0},
    "repetition": {"repetition_penalty": 2.0},
    "repetition_below_1": {"repetition_penalty": 0.5},
    "all_penalties": {"presence_penalty": 1.0, "frequency_penalty": 0.5,
                      "repetition_penalty": 1.5},
}

SAMPLES = 2000
# T = 1 on the small target, in one batch: penalties next to min_p next to plain
SAMPLED_MIX = [  # ids in [2, 9): not bos / eos / the small target's mask token 9
    ([5, 8, 3, 7], {"presence_penalty": 1.5, "frequency_penalty": 0.5,
                    "repetition_penalty": 1.5}),
    ([6, 2, 8, 4], {"min_p": 0.15}),
    ([4, 2, 6, 8], {}),
    # a grammar (words of the small target's tokenizer): w2-w4, then w5-w8, ...; eos
    # ends the output where the grammar allows it
    ([3, 7, 2, 5], {"structured_outputs": {"regex": "(w[2-4]w[5-8])+"},
                    "ignore_eos": False}),
]
SAMPLED_RE = r"(w[2-4]w[5-8])*(w[2-4])?"  # a prefix of the grammar's language
SMALL = {"vocab_size": 10, "logit_scale": 8.0}  # the small target's tiny_models params


def job(name, prompts, sampling) -> dict:
    return {"name": name, "prompts": prompts, "sampling": sampling}


def feature_jobs(prompts_of) -> list[dict]:
    """FEATURES as greedy jobs; prompts_of(k) -> the prompts of the k-th job."""
    return [job(f"feature_{name}", prompts_of(k), {**GREEDY, **extra})
            for k, (name, extra) in enumerate(FEATURES.items())]


def penalty_jobs(prompts_of) -> list[dict]:
    return [job(f"penalty_{name}", prompts_of(k), {**GREEDY, **extra})
            for k, (name, extra) in enumerate(PENALTIES.items())]


def plain_job(name, jobs) -> dict:
    """Plain greedy over the prompts of ``jobs``, in order (what the features change)."""
    return job(name, [p for j in jobs for p in j["prompts"]], GREEDY)


def changed(run: dict, feature: dict, plain: dict) -> int:
    """How many prompts of job ``feature`` get another output in ``run`` than under
    job ``plain`` (a plain_job over job definitions that include ``feature``)."""
    base = {tuple(p): t for p, t in zip(plain["prompts"],
                                         run["jobs"][plain["name"]]["token_ids"])}
    got = run["jobs"][feature["name"]]["token_ids"]
    return sum(base[tuple(p)] != t for p, t in zip(feature["prompts"], got))


def bad_words_job(prompts, base) -> dict:
    """Per prompt i: the plain output's 6th token and its 10th-11th tokens as bad words
    (one word and a two-token word: vLLM bans the last token after the prefix)."""
    per = [{**GREEDY, "bad_words": [f"w{b[5]}", f"w{b[9]} w{b[10]}"]} for b in base]
    return job("feature_bad_words", prompts, per)


def min_tokens_job(prompt, stop_token, stop_at) -> dict:
    """A stop token first emitted at stop_at, with min_tokens past it: masked there, so
    the output goes on (and may stop later)."""
    return job("feature_min_tokens", [prompt],
               {"temperature": 0.0, "max_tokens": 32, "stop_token_ids": [stop_token],
                "min_tokens": stop_at + 4})


def mixed_job(prompts) -> dict:
    """One batch, one request per feature next to a plain one (greedy)."""
    per = [GREEDY, {**GREEDY, **FEATURES["penalties"]}, {**GREEDY, **FEATURES["logit_bias"]},
           {**GREEDY, "logprobs": 2}, {**GREEDY, **FEATURES["allowed"]},
           {**GREEDY, "min_p": 0.2}]
    return job("feature_mixed", prompts[:len(per)], per)


# structured outputs (the tokenizer engines: token i is the word "w<i>"; grammars see
# the words without spaces).  "regex" takes the ~110 words w1x of 512 anywhere;
# "pairs" a w2x word, then w3x w4x pairs: a position allows ~110 words, and every word
# the grammar allows can be continued (a choice of literal strings would not: "w6" is a
# prefix of "w60"), so outputs end only where the model picks eos.
STRUCTURED = {
    "regex": {"regex": "(w1[0-9]*)+"},
    "pairs": {"regex": "w2[0-9]*(w3[0-9]*w4[0-9]*)+"},
}
STRUCTURED_RE = {"regex": r"(w1[0-9]*)+", "pairs": r"w2[0-9]*(w3[0-9]*w4[0-9]*)+",
                 "mixed": r"(w1[0-9]*)+"}


def structured_jobs(prompts_of) -> list[dict]:
    """Greedy jobs under each STRUCTURED grammar (stopping at the grammar's end), a
    plain greedy job over the same prompts (what the grammar changes) and one batch
    with a structured request next to a plain one next to one with penalties."""
    out = [job(f"structured_{name}", prompts_of(k),
               {"temperature": 0.0, "max_tokens": 24, "structured_outputs": extra})
           for k, (name, extra) in enumerate(STRUCTURED.items())]
    out.append(plain_job("structured_plain", out))
    mixed = prompts_of(len(STRUCTURED))[:3]
    out.append(job("structured_mixed", mixed, [
        {"temperature": 0.0, "max_tokens": 24, "structured_outputs": STRUCTURED["regex"]},
        GREEDY, {**GREEDY, **FEATURES["penalties"]}]))
    return out


def words(token_ids) -> str:
    """The text a grammar saw: the words of the tokens, without spaces."""
    return "".join(f"w{t}" for t in token_ids)


def sampled_mix_job() -> dict:
    return job("sampled_mix", [p for p, _ in SAMPLED_MIX],
               [{"temperature": 1.0, "max_tokens": 3, "n": SAMPLES, "ignore_eos": True,
                 **extra} for _, extra in SAMPLED_MIX])


def outputs(run: dict, name: str) -> list[dict]:
    """First completion of every prompt of job ``name`` (run 0)."""
    return [o[0] for o in run["jobs"][name]["runs"][0]["outputs"]]


def logprob_gap(ref: list[dict], got: list[dict]) -> float:
    """Largest |logprob difference| over every emitted token's entries; the token ids
    of each position's entries must be the same."""
    worst = 0.0
    for a, b in zip(ref, got, strict=True):
        assert a["logprobs"] and len(a["logprobs"]) == len(b["logprobs"]) == \
            len(a["token_ids"]), (a, b)
        for x, y in zip(a["logprobs"], b["logprobs"]):
            assert set(x) == set(y), (x, y)
            worst = max(worst, max(abs(x[k] - y[k]) for k in x))
    return worst


def pooled(a: list, b: list, least: int = 20) -> list[list[int]]:
    """Contingency table of two samples: one row per outcome seen >= ``least`` times in
    both together (most frequent first), the rest pooled into a last row."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a.count(k) + b.count(k)))
    rows, other = [], [0, 0]
    for k in keys:
        x, y = a.count(k), b.count(k)
        if x + y >= least:
            rows.append([x, y])
        else:
            other[0] += x
            other[1] += y
    return rows + ([other] if sum(other) else [])


def chi_square(ref: list[tuple], got: list[tuple]) -> tuple[float, float, int]:
    """(p of the joint, p of the repeat pattern, cells of the joint) for two samples
    of 3-token outputs (``pooled`` tables).  Pattern: which positions hold the same
    token (a function of the joint, so its distribution is kept too); it is what
    penalties counted over the wrong tokens move."""
    from scipy.stats import chi2_contingency

    def pattern(xs):
        return [(x[0] == x[1], x[1] == x[2], x[0] == x[2]) for x in xs]

    joint, pat = pooled(ref, got), pooled(pattern(ref), pattern(got))
    p_pat = chi2_contingency(pat)[1] if len(pat) > 1 else 1.0
    return chi2_contingency(joint)[1], p_pat, len(joint)


def marginal_p(ref: list[tuple], got: list[tuple]) -> float:
    """The smallest p over the chi-squares of each position's token (``pooled``
    tables): at a small vocabulary each has well-filled cells where the joint of
    several tokens pools most outcomes into one row."""
    from scipy.stats import chi2_contingency

    ps = []
    for i in range(min(len(x) for x in ref + got)):
        t = pooled([x[i] for x in ref], [x[i] for x in got])
        ps.append(chi2_contingency(t)[1] if len(t) > 1 else 1.0)
    return min(ps)


# JSON (the bytes pair: the default target with a byte-level BPE tokenizer, which writes
# any text): a schema whose every field ends (enum, boolean, bounded integer, short
# string of letters), xgrammar without free whitespace (else a random model writes
# whitespace)
JSON_SCHEMA = {"type": "object", "additionalProperties": False,
               "required": ["ok", "color", "n", "name"],
               "properties": {"ok": {"type": "boolean"},
                              "color": {"enum": ["red", "green", "blue"]},
                              "n": {"type": "integer", "minimum": 0, "maximum": 99},
                              "name": {"type": "string", "pattern": "^[a-z]{1,6}$"}}}
JSON_CONFIG = {"backend": "xgrammar", "disable_any_whitespace": True}
JSON_GREEDY = {"temperature": 0.0, "max_tokens": 64}


def json_jobs(prompts_of) -> list[dict]:
    """A JSON-schema job, the same prompts plain, and one batch with a JSON request
    next to a regex one next to a plain one with penalties (outputs decoded)."""
    js = {**JSON_GREEDY, "structured_outputs": {"json": JSON_SCHEMA}}
    out = [job("json_schema", prompts_of(0), js)]
    out.append(plain_job("json_plain", out))
    out.append(job("json_mixed", prompts_of(1)[:3], [
        js, {**JSON_GREEDY, "structured_outputs": {"regex": "[a-z]{2,8}( [a-z]{2,8}){1,5}"}},
        {**GREEDY, **FEATURES["penalties"]}]))
    for j in out:
        j["decode"] = True
    return out


def check_json_job(ref_run: dict, got_run: dict, jobs: dict, job: str, stats: dict,
                   depth: int) -> None:
    """A JSON job (json_schema / json_mixed) of DDTree against no-spec: equal token for
    token, every JSON answer complete and valid, the schema changed the output, drafts
    accepted, paths as deep as the drafter goes, the grammar kept drafts (V1 and V2)."""
    ref, got = outputs(ref_run, job), outputs(got_run, job)
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in ref]
    answers = got[:1] if job == "json_mixed" else got
    assert all(o["finish_reason"] == "stop" and json_valid(o["text"])
               for o in answers), [o["text"] for o in answers]
    if job == "json_schema":
        assert changed(ref_run, jobs[job], jobs["json_plain"]) >= 3
    assert got_run["jobs"][job]["metrics"]["num_accepted_tokens"] > 0
    assert stats["accepted_per_depth"].get(str(depth), 0) > 0 \
        and stats.get("grammar_kept", 0) > 0, stats


def json_valid(text: str) -> bool:
    """text is one JSON object that JSON_SCHEMA accepts."""
    import json
    import re

    try:
        obj = json.loads(text)
    except ValueError:
        return False
    props = JSON_SCHEMA["properties"]
    return (isinstance(obj, dict) and sorted(obj) == sorted(props)
            and isinstance(obj["ok"], bool) and obj["color"] in props["color"]["enum"]
            and type(obj["n"]) is int and 0 <= obj["n"] <= 99
            and isinstance(obj["name"], str) and re.fullmatch("[a-z]{1,6}", obj["name"]))
