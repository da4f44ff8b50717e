"""Rank determinism of the payload (tensor parallelism: every rank runs the same step).

Two independent "ranks" (runner, proposer, runtime, sampler each) get identical inputs
(the drafter's and the target's all-gathered logits, the scheduler's batch, a seeded
request's own generator) while each rank's torch global RNG is put in a different
state: they must build bit-identical trees, walk them to the same paths (greedy,
seeded sampled and unseeded sampled rows), and commit identically (positions, input
ids, the drafter's aux rows, KV).  The step never draws from torch's global RNG.
CPU (torch paths); on CUDA also the fused paths, and CUDA's global generators are
checked too.
"""

import importlib.util
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from .conftest import HAS_CUDA, payload_module, spec_config
from .test_cuda_runtime import _impl, _kv_cache, _runtime_module

B, L, V, BS = 6, 3, 16, 8
REQS = ["a", "b", "c"]  # a: sampled unseeded, b: greedy, c: sampled with its own seed
CTX = {"a": 10, "b": 20, "c": 5}
SEED_C = 1234


def _proposer_class(monkeypatch):
    """payload/proposer.py's DDTreeProposer over a stand-in DFlashProposer whose
    propose() ends, as vLLM's does, in _sample_draft_tokens on the drafter's output
    (here: the logits themselves).  Loaded as a fresh module so a real vLLM next to
    the tests is not needed and not touched."""
    payload_module("v1.sampler")  # the package and core, as the runtime tests load them

    class DFlashProposer:
        def __init__(self, *a, **k):
            pass

        def propose(self, num_speculative_tokens, hidden_states=None, **kwargs):
            return self._sample_draft_tokens(hidden_states, None)[0]

        def _sample_draft_tokens(self, hidden_states, sampling_metadata):
            raise AssertionError("DDTreeProposer overrides it")

    stub = types.ModuleType("vllm.v1.spec_decode.dflash")
    stub.DFlashProposer = DFlashProposer
    monkeypatch.setitem(sys.modules, "vllm.v1.spec_decode.dflash", stub)
    v1 = payload_module("v1")
    path = Path(v1.__file__).parent / "proposer.py"
    spec = importlib.util.spec_from_file_location(f"{v1.__name__}._proposer_tp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.DDTreeProposer


class Rank:
    """One rank's runner, runtime and proposer (fresh state, shared inputs)."""

    def __init__(self, cr, proposer_cls, kind, dev, engine_seed, synthetic_path):
        self.dev = dev
        self.positions = torch.zeros(32, dtype=torch.int64, device=dev)
        self.kv, self.slots_of = _kv_cache("heads_packed", dev, BS)
        self.bt = torch.arange(12, dtype=torch.int32, device=dev).view(3, 4)
        qsl = np.array([0, 7, 14, 21, 21], dtype=np.int32)
        runner = SimpleNamespace(
            device=torch.device(dev), max_num_reqs=4, sampler=None,
            model_config=SimpleNamespace(seed=engine_seed),
            speculative_config=spec_config(B, L),
            positions=self.positions,
            input_ids=SimpleNamespace(gpu=torch.arange(100, 132, device=dev)),
            query_start_loc=SimpleNamespace(np=qsl, cpu=torch.from_numpy(qsl)),
            input_batch=SimpleNamespace(req_ids=REQS, block_table=[
                SimpleNamespace(get_device_tensor=lambda n: self.bt[:n])]),
            kv_cache_config=SimpleNamespace(kv_cache_groups=[
                SimpleNamespace(layer_names=["model.layers.0.attn"])]),
            requests={r: SimpleNamespace(prompt_token_ids=[2 + i, 3, 4])
                      for i, r in enumerate(REQS)},
            compilation_config=SimpleNamespace(static_forward_context={
                "model.layers.0.attn": SimpleNamespace(impl=_impl("TritonAttentionImpl"),
                                                       kv_cache=self.kv)}),
            drafter=SimpleNamespace(_draft_attn_layer_names=set()))
        self.runner = runner
        rt_cls = cr.CudaDDTreeRuntime if kind == "cuda_runtime" else cr.DDTreeRuntime
        runner.ddtree = self.rt = rt_cls(runner)
        p = object.__new__(proposer_cls)
        p.ddtree_budget, p.ddtree_depth, p.num_speculative_tokens = B, L, L
        p.model = SimpleNamespace(compute_logits=lambda h: h)
        p._ddtree_runner, p._ddtree_tokens, p._ddtree_call = runner, None, None
        p._ddtree_synthetic, p.ddtree_controller = None, None
        if synthetic_path:  # request "a" gets the synthetic drafter's distributions
            synth = payload_module("synthetic").SyntheticDrafter
            p._ddtree_synthetic = synth.load(synthetic_path)
        self.proposer = p
        # vLLM gives every rank its own generator for a seeded request
        self.gen_c = torch.Generator(device=dev).manual_seed(SEED_C)
        self.aux = [torch.arange(32.0, device=dev).unsqueeze(1).repeat(1, 4)]

    def step(self, draft_logits, target_logits):
        """proposer -> prepare -> tree walk -> commit, as the patched runner calls
        them; returns everything a rank decides in the step."""
        seq_lens = torch.tensor([CTX[r] + 1 for r in REQS])
        cad = SimpleNamespace(seq_lens=seq_lens)
        hidden = draft_logits.to(self.dev).reshape(-1, V)  # compute_logits: identity
        # the runner asks for B drafts (vLLM's num_spec_tokens_to_schedule)
        tokens = self.proposer.propose(B, hidden_states=hidden, common_attn_metadata=cad)
        spec = {r: tokens[i].tolist() for i, r in enumerate(REQS)}
        lin = torch.cat([torch.arange(CTX[r], CTX[r] + 1 + B) for r in REQS]).to(self.dev)
        self.positions[:21] = lin
        self.rt.prepare(SimpleNamespace(scheduled_spec_decode_tokens=spec), 21)
        tree_pos = self.positions[:21].clone()
        md = SimpleNamespace(
            all_greedy=False, temperature=torch.tensor([1.0, 0.0, 1.0], device=self.dev),
            top_k=None,
            top_p=None, generators={2: self.gen_c})
        out = self.rt.sampler(SimpleNamespace(num_draft_tokens=[B, B, B]), None,
                              target_logits.to(self.dev), md).sampled_token_ids
        walk = self.rt.walk
        self.rt.commit(self.aux)
        return {"tokens": tokens.clone(), "tree_positions": tree_pos,
                "sampled": out.clone(), "rows": walk.accepted_rows.clone(),
                "positions": self.positions.clone(),
                "input_ids": self.runner.input_ids.gpu.clone(),
                "aux": self.aux[0].clone(), "kv": self.kv.clone()}


def _global_rng_states():
    s = [torch.get_rng_state()]
    if torch.cuda.is_available():
        s += list(torch.cuda.get_rng_state_all())
    return s


def _inputs(step):
    g = torch.Generator().manual_seed(100 + step)
    draft = torch.randn(3, L, V, generator=g) * 2
    target = torch.randn(21, V, generator=g)
    return draft, target


@pytest.fixture
def synthetic(tmp_path):
    path = tmp_path / "synthetic.json"
    seq = [2, 3, 4] + list(range(5, 15))  # request a's prompt and its "continuation"
    path.write_text('{"sequences": [%s], "rank_probs": [0.5, 0.3], "seed": 1}'
                    % seq)
    return str(path)


@pytest.mark.parametrize("kind, dev", [("cuda_runtime", "cpu"), ("cpu_runtime", "cpu")] +
                         ([("cuda_runtime", "cuda")] if HAS_CUDA else []))
def test_two_ranks_decide_bit_identically(kind, dev, monkeypatch, synthetic):
    """On CUDA: the fused Triton bookkeeping, tree build and walk, CUDA generators."""
    cr = _runtime_module(monkeypatch)
    proposer_cls = _proposer_class(monkeypatch)
    ranks = [Rank(cr, proposer_cls, kind, dev, 0, synthetic) for _ in range(2)]
    other_seed = Rank(cr, proposer_cls, kind, dev, 1, synthetic)  # another engine seed
    changed_unseeded = False
    for step in range(4):
        draft, target = _inputs(step)
        results = []
        for r, rank in enumerate(ranks + [other_seed]):
            torch.manual_seed(1000 * r + step)  # every rank's global RNG differs
            before = _global_rng_states()
            results.append(rank.step(draft, target))
            after = _global_rng_states()
            # the payload drew nothing from torch's global RNG
            assert all(torch.equal(x, y) for x, y in zip(before, after)), step
        a, b, c = results
        for key in a:
            assert torch.equal(a[key], b[key]), (step, key)
        # the trees really are trees with depth positions (not chains)
        assert int((a["tree_positions"][1:7] - CTX["a"]).max()) <= L
        assert (a["tokens"][0] != 0).any()
        # another engine seed: seeded and greedy rows unchanged, so the uniforms of
        # unseeded rows come from the engine seed (and the test above could fail)
        assert torch.equal(a["sampled"][1:], c["sampled"][1:])
        changed_unseeded |= not torch.equal(a["sampled"][0], c["sampled"][0])
    assert changed_unseeded


def test_tree_build_is_a_function_of_the_input_bits():
    """Exact ties everywhere (integer logits over a few values): a request's tree
    depends only on its logits (contiguous, as the proposer passes them; the
    logsumexp of a strided copy may differ in the last bit), not on the other rows,
    a fresh copy or the global RNG."""
    core = payload_module("core")
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (4, L, V), generator=g).float()
    ref = core.build_tree(logits, B, B, backend="torch")
    torch.manual_seed(7)
    again = core.build_tree(logits.clone(), B, B, backend="torch")
    flipped = core.build_tree(logits.flip(0), B, B, backend="torch")
    for f in ("tokens", "parents", "depths", "num_nodes", "scores", "ancestor_mask"):
        assert torch.equal(getattr(ref, f), getattr(again, f)), f
        assert torch.equal(getattr(ref, f), getattr(flipped, f).flip(0)), f
    # ties were resolved by token id (ascending) among equal log-probs
    d1 = [(t, p) for t, p, d in zip(ref.tokens[0].tolist(), ref.parents[0].tolist(),
                                   ref.depths[0].tolist()) if d == 1]
    best = logits[0, 0].max()
    ids = [t for t, _ in d1 if logits[0, 0, t] == best]
    assert ids == sorted(ids)
