"""framework.hook: one declarative hook (guard, payload import, body, else branch) as
a Step that lands once, is idempotent by its marker and fails closed without its
anchor; the DDTree guards (patches/ddtree/hooks.py).  No wheel needed."""

import pytest

from ddtree_patcher.patches.ddtree.hooks import PKG, RUNTIME, on
from ddtree_patcher.patches.framework import AnchorError, file_edit, hook, hook_code

SRC = '''class Runner:
    def __init__(self, spec):
        self.speculative_config = spec
        self.drafter = make_drafter(self)
        self.done = True
'''


def test_hook_code():
    assert hook_code("run(self)") == "run(self)\n"
    assert hook_code("run(self)", imports=("config", "run"), package="pkg") == \
        "from pkg.config import run\nrun(self)\n"
    assert hook_code("a = 1\nb = 2\n", guard="x", imports=("m", "a, b"), package="p",
                     orelse="c = 3") == \
        "if x:\n    from p.m import a, b\n\n    a = 1\n    b = 2\nelse:\n    c = 3\n"
    assert on("self.speculative_config") == \
        "self.speculative_config is not None and self.speculative_config.use_ddtree()"
    assert on("l.spec", "getattr(l, 'spec', None)") == \
        "getattr(l, 'spec', None) is not None and l.spec.use_ddtree()"
    assert PKG == "vllm.v1.spec_decode.ddtree" and "ddtree" in RUNTIME


def test_a_hook_lands_once_and_runs_only_when_guarded():
    step = hook("Runner.__init__", "self.drafter = Tree(self)",
                guard=on("self.speculative_config"), imports=("v1.proposer", "Tree"),
                package="toy", orelse="self.drafter = make_drafter(self)",
                at=lambda c: c.strip() == "self.drafter = make_drafter(self)", replace=True)
    assert step.marker == "self.drafter = Tree(self)"
    edit = file_edit("runner.py", [step])
    out = edit.apply(SRC)
    assert edit.is_applied(out) and not edit.is_applied(SRC) and edit.apply(out) == out
    assert out.count("from toy.v1.proposer import Tree") == 1
    made = []
    ns = {"make_drafter": lambda r: made.append("stock") or "stock"}
    exec(out, ns)  # noqa: S102
    spec = type("Spec", (), {"use_ddtree": lambda self: False})()
    assert ns["Runner"](spec).drafter == "stock" and ns["Runner"](None).drafter == "stock"
    with pytest.raises(AnchorError):
        edit.apply(SRC.replace("make_drafter(self)", "other(self)"))


def test_a_hook_at_the_start_and_before_an_anchor():
    start = file_edit("r.py", [hook("Runner.__init__", "check(spec)", guard=RUNTIME)])
    out = start.apply(SRC)
    body = out.splitlines()
    assert body[2].strip() == f"if {RUNTIME}:" and body[3].strip() == "check(spec)"
    before = file_edit("r.py", [hook("Runner.__init__", "self.x = 1", marker="self.x",
                                     at=lambda c: c.strip() == "self.done = True",
                                     before=True)])
    out = before.apply(SRC)
    assert out.index("self.x = 1") < out.index("self.done = True")
    assert before.apply(out) == out
