"""The transform framework: what a versioned transform declares, and libcst helpers.

A ``Transform`` (one package under ``patches/``) maps version families to a ``Family``:
the file edits (libcst codemods) and added files for those versions, or ``upstream=True``
when the release already contains the change (its edits' detectors must then hold and
nothing is written).  Every helper fails closed: an anchor that is not found exactly
once raises ``AnchorError`` and the engine writes nothing.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from dataclasses import dataclass, field
from typing import Callable, Sequence

import libcst as cst
import libcst.matchers as m


class AnchorError(Exception):
    """An anchor was not found exactly once."""


@dataclass(frozen=True)
class FileEdit:
    path: str  # relative to site-packages, e.g. "vllm/v1/worker/gpu_model_runner.py"
    apply: Callable[[str], str]  # source -> patched source
    is_applied: Callable[[str], bool]  # does the source already contain the change?
    what: str = ""


@dataclass(frozen=True)
class AddedFile:
    path: str
    content: Callable[[], bytes]
    what: str = ""


@dataclass(frozen=True)
class Family:
    versions: tuple[str, ...]
    edits: tuple[FileEdit, ...] = ()
    added: tuple[AddedFile, ...] = ()
    upstream: bool = False  # the release already has it: detect, write nothing
    note: str = ""


@dataclass(frozen=True)
class Transform:
    name: str
    summary: str
    families: tuple[Family, ...]
    reference: str = ""
    requires: tuple[str, ...] = field(default=())

    def family(self, version: str) -> Family | None:
        for fam in self.families:
            if version in fam.versions:
                return fam
        return None

    def files(self) -> set[str]:
        return {e.path for fam in self.families for e in fam.edits}


# ---------------------------------------------------------------- libcst helpers


@functools.lru_cache(maxsize=16)
def parse(source: str) -> cst.Module:
    """Parse once per distinct source (libcst trees are immutable; big files take ~1 s)."""
    return cst.parse_module(source)


def _qualnames(module: cst.Module) -> list[tuple[str, cst.FunctionDef]]:
    out: list[tuple[str, cst.FunctionDef]] = []

    def walk(body: Sequence[cst.CSTNode], prefix: str) -> None:
        for stmt in body:
            if isinstance(stmt, cst.FunctionDef):
                out.append((prefix + stmt.name.value, stmt))
            elif isinstance(stmt, cst.ClassDef):
                walk(stmt.body.body, prefix + stmt.name.value + ".")
            elif isinstance(stmt, cst.If):  # e.g. "if TYPE_CHECKING:" blocks
                walk(stmt.body.body, prefix)

    walk(module.body, "")
    return out


def find_function(module: cst.Module, qualname: str) -> cst.FunctionDef:
    hits = [fn for name, fn in _qualnames(module) if name == qualname]
    if len(hits) != 1:
        raise AnchorError(f"function {qualname} found {len(hits)} times (need exactly 1)")
    return hits[0]


@functools.lru_cache(maxsize=16)
def _ast(source: str) -> ast.Module:
    return ast.parse(source)


def function_code(source: str, qualname: str) -> str | None:
    """Source of one function, or None when it is not there exactly once.  Uses ``ast``
    (about 10x faster than libcst): detectors run on every status and plan."""
    try:
        return ast.get_source_segment(source, _find_ast_function(source, qualname))
    except AnchorError:
        return None


def edit_function(source: str, qualname: str,
                  edit: Callable[[cst.FunctionDef], cst.FunctionDef | cst.FlattenSentinel]
                  ) -> str:
    """Apply a libcst edit to one function (found exactly once) and splice it back.

    Only the function's own lines go through libcst (vLLM's runner is 6000+ lines and a
    whole-file round trip costs seconds); ``ast`` locates them exactly.  The edit may
    return several statements (``cst.FlattenSentinel``), e.g. to add a method after it.
    """
    node = _find_ast_function(source, qualname)
    lines = source.splitlines(keepends=True)
    start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    end = node.end_lineno
    segment = "".join(lines[start:end])
    indent = segment[: len(segment) - len(segment.lstrip(" "))]
    body = textwrap.dedent(segment)
    if not body.startswith(("def ", "async def ", "@")) or \
            any(line.strip() and not line.startswith(indent) for line in lines[start:end]):
        return _edit_function_whole(source, qualname, edit)  # odd indentation: slow path
    module = cst.parse_module(body)
    fn = module.body[0]
    new = edit(fn)
    stmts = list(new.nodes) if isinstance(new, cst.FlattenSentinel) else [new]
    code = module.with_changes(body=stmts).code
    code = "".join(indent + line if line.strip() else line
                   for line in code.splitlines(keepends=True))
    return "".join(lines[:start]) + code + "".join(lines[end:])


def _find_ast_function(source: str, qualname: str) -> ast.AST:
    hits = []

    def walk(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if prefix + node.name == qualname:
                    hits.append(node)
            elif isinstance(node, ast.ClassDef):
                walk(node.body, prefix + node.name + ".")
            elif isinstance(node, ast.If):
                walk(node.body, prefix)

    walk(_ast(source).body, "")
    if len(hits) != 1:
        raise AnchorError(f"function {qualname} found {len(hits)} times (need exactly 1)")
    return hits[0]


def _edit_function_whole(source: str, qualname: str, edit) -> str:
    module = parse(source)
    target = find_function(module, qualname)
    new = edit(target)

    class Swap(cst.CSTTransformer):
        def leave_FunctionDef(self, original, updated):
            return new if original is target else updated

    return module.visit(Swap()).code


def replace_one(node: cst.CSTNode, matcher, replacement, where: str = ""):
    """Replace the single node matching ``matcher`` inside ``node`` (``replacement`` is a
    node, or a callable (matched_node, captures) -> node)."""
    hits = m.findall(node, matcher)
    if len(hits) != 1:
        raise AnchorError(f"anchor {where or matcher} found {len(hits)} times (need exactly 1)")
    return m.replace(node, matcher, replacement)


def expr(code: str) -> cst.BaseExpression:
    return cst.parse_expression(code)


def stmt(code: str) -> cst.BaseStatement:
    return cst.parse_statement(code)
