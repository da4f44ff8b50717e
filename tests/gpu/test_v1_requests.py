"""payload/v1/requests.py without vLLM: which request each verify row belongs to.

The CUDA V1 runner's profile run (_dummy_sampler_run) calls the tree sampler with
rows and no requests; H200 run 15 died there with an IndexError (the CPU runner has no
such run, so the engine tier could not see it)."""

from types import SimpleNamespace

import torch

from .conftest import payload_module

rq = payload_module("v1.requests")


def _runner(req_ids, requests):
    return SimpleNamespace(input_batch=SimpleNamespace(req_ids=req_ids), requests=requests)


def test_rows_without_requests_are_none():
    params = SimpleNamespace(min_p=0.25, presence_penalty=0.0, frequency_penalty=0.0,
                             repetition_penalty=1.0, allowed_token_ids=None,
                             logit_bias=None, bad_words_token_ids=None, min_tokens=0)
    req = SimpleNamespace(sampling_params=params, output_token_ids=[4, 5])
    assert rq.batch_requests(_runner([], {}), 3) == [None, None, None]  # the profile run
    got = rq.batch_requests(_runner(["a", "b"], {"a": req}), 4)
    assert got == [(params, [4, 5]), None, None, None]
    assert rq.min_p_of(got, 4, "cpu").tolist() == [0.25, 0.0, 0.0, 0.0]
    assert rq.min_p_of([None] * 3, 3, "cpu") is None
    rows = torch.randn(3, 2, 7)
    assert rq.process_rows(rows, None, [None] * 3, None) is rows  # nothing to process
