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
import importlib
import textwrap
from dataclasses import dataclass, field
from typing import Callable, Sequence



class _Lazy:
    """A module imported on first use: libcst takes ~1 s to import, and status, list,
    revert and recover never need it."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)


cst = _Lazy("libcst")
m = _Lazy("libcst.matchers")


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
        node = _find_ast_function(source, qualname)
    except AnchorError:
        return None
    return "".join(_lines(source)[node.lineno - 1: node.end_lineno])


@functools.lru_cache(maxsize=16)
def _lines(source: str) -> tuple[str, ...]:
    return tuple(source.splitlines(keepends=True))


def edit_function(source: str, qualname: str,
                  edit: Callable[[cst.FunctionDef], cst.FunctionDef | cst.FlattenSentinel]
                  ) -> str:
    """Apply a libcst edit to one function (found exactly once) and splice it back.

    Only the function's own lines go through libcst (vLLM's runner is 6000+ lines and a
    whole-file round trip costs seconds); ``ast`` locates them exactly.  The edit may
    return several statements (``cst.FlattenSentinel``), e.g. to add a method after it.
    """
    node = _find_ast_function(source, qualname)
    return _splice(source, node, edit, lambda: _edit_function_whole(source, qualname, edit))


def edit_statement(source: str, where: str, locate: Callable[[ast.stmt], bool],
                   edit: Callable[[cst.BaseStatement], cst.BaseStatement | cst.FlattenSentinel]
                   ) -> str:
    """Like edit_function for one statement found by an ``ast`` predicate over the
    statements of a class body (``where`` = class qualname) or the module (``""``)."""
    body = _ast(source).body
    for part in [p for p in where.split(".") if p]:
        hits = [n for n in body if isinstance(n, ast.ClassDef) and n.name == part]
        if len(hits) != 1:
            raise AnchorError(f"class {part} found {len(hits)} times (need exactly 1)")
        body = hits[0].body
    hits = [n for n in body if locate(n)]
    if len(hits) != 1:
        raise AnchorError(f"statement in {where or 'module'} found {len(hits)} times "
                          "(need exactly 1)")
    return _splice(source, hits[0], edit, None)


def _splice(source: str, node: ast.AST, edit, slow) -> str:
    lines = source.splitlines(keepends=True)
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
    end = node.end_lineno
    segment = "".join(lines[start:end])
    indent = segment[: len(segment) - len(segment.lstrip(" "))]
    if any(line.strip() and not line.startswith(indent) for line in lines[start:end]):
        if slow is None:
            raise AnchorError("statement with unusual indentation")
        return slow()  # e.g. a docstring line indented less than the def
    module = cst.parse_module(textwrap.dedent(segment))
    new = edit(module.body[0])
    stmts = list(new.nodes) if isinstance(new, cst.FlattenSentinel) else [new]
    code = module.with_changes(body=stmts).code
    code = "".join(indent + line if line.strip() else line
                   for line in code.splitlines(keepends=True))
    return "".join(lines[:start]) + code + "".join(lines[end:])


def code_of(node: cst.CSTNode) -> str:
    """Source of one node (without the indentation of its block)."""
    return cst.Module([]).code_for_node(node)


def statements(code: str) -> list[cst.BaseStatement]:
    """Parse code into statements, keeping leading comments on the first one."""
    mod = cst.parse_module(textwrap.dedent(code))
    body = list(mod.body)
    if body and mod.header:
        body[0] = body[0].with_changes(leading_lines=[*mod.header, *body[0].leading_lines])
    return body


def insert_near(source: str, qualname: str, match: Callable[[str], bool], code,
                before: bool = False, replace: bool = False) -> str:
    """Insert ``code`` after (or before, or instead of) the one simple statement of a
    function whose source satisfies ``match``; libcst indents it for its block.
    ``code`` may also be a callable: anchor statement -> the statements replacing it
    (``replace`` implied), e.g. a branch that keeps the original statement."""
    build = code if callable(code) else None
    new = None if build else statements(code)

    def edit(fn):
        hits = []

        class Find(cst.CSTVisitor):
            def visit_SimpleStatementLine(self, node):
                if match(code_of(node)):
                    hits.append(node)

        fn.visit(Find())
        if len(hits) != 1:
            raise AnchorError(f"anchor statement in {qualname} found {len(hits)} times "
                              "(need exactly 1)")

        class Insert(cst.CSTTransformer):
            def leave_SimpleStatementLine(self, original, updated):
                if original is not hits[0]:
                    return updated
                if build is not None:
                    return cst.FlattenSentinel(build(updated))
                if replace:
                    return cst.FlattenSentinel(new)
                if before:  # blank lines above the anchor go above the new code
                    lines = list(updated.leading_lines)
                    k = 0
                    while k < len(lines) and lines[k].comment is None:
                        k += 1
                    first = new[0].with_changes(
                        leading_lines=lines[:k] + list(new[0].leading_lines))
                    return cst.FlattenSentinel(
                        [first] + new[1:] + [updated.with_changes(leading_lines=lines[k:])])
                return cst.FlattenSentinel([updated] + new)

        return fn.visit(Insert())

    return edit_function(source, qualname, edit)


def insert_at_start(source: str, qualname: str, code: str) -> str:
    """Insert ``code`` as the first statements of a function (after its docstring)."""
    new = statements(code)

    def edit(fn):
        body = list(fn.body.body)
        at = 1 if body and m.matches(body[0], m.SimpleStatementLine(
            body=[m.Expr(m.SimpleString() | m.ConcatenatedString())])) else 0
        return fn.with_changes(body=fn.body.with_changes(body=body[:at] + new + body[at:]))

    return edit_function(source, qualname, edit)


def add_after_function(source: str, qualname: str, code: str) -> str:
    """Add functions / methods right after ``qualname`` (same indentation)."""
    new = statements(code)
    new[0] = new[0].with_changes(leading_lines=[cst.EmptyLine(), *new[0].leading_lines])
    return edit_function(source, qualname, lambda fn: cst.FlattenSentinel([fn] + new))


def insert_class_statements(source: str, cls: str, after: Callable[[ast.stmt], bool],
                            code: str) -> str:
    """Add class-body statements (e.g. fields) after the one statement ``after``
    selects, keeping a docstring that follows it attached to it."""
    body = _ast(source).body
    for part in cls.split("."):
        hits = [n for n in body if isinstance(n, ast.ClassDef) and n.name == part]
        if len(hits) != 1:
            raise AnchorError(f"class {part} found {len(hits)} times (need exactly 1)")
        body = hits[0].body
    idx = [i for i, n in enumerate(body) if after(n)]
    if len(idx) != 1:
        raise AnchorError(f"anchor in class {cls} found {len(idx)} times (need exactly 1)")
    i = idx[0]
    if i + 1 < len(body) and isinstance(body[i + 1], ast.Expr) and \
            isinstance(getattr(body[i + 1], "value", None), ast.Constant) and \
            isinstance(body[i + 1].value.value, str):
        i += 1
    anchor = body[i]
    lines = source.splitlines(keepends=True)
    first = lines[body[0].lineno - 1]
    indent = first[: len(first) - len(first.lstrip(" "))]
    statements(code)  # must parse
    block = "".join(indent + line if line.strip() else line
                    for line in textwrap.dedent(code).splitlines(keepends=True))
    if not block.endswith("\n"):
        block += "\n"
    return "".join(lines[: anchor.end_lineno]) + block + "".join(lines[anchor.end_lineno:])


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


# ---------------------------------------------------------------- edits made of steps


@dataclass(frozen=True)
class Step:
    """One anchored edit inside a file; ``marker`` is text the edited function (or, with
    qualname "", the file) contains once the step is applied, or a predicate on it."""

    qualname: str
    apply: Callable[[str], str]
    marker: str | Callable[[str], bool]


def _step_applied(source: str, step: Step) -> bool:
    code = function_code(source, step.qualname) if step.qualname else source
    if code is None:
        return False
    return step.marker(code) if callable(step.marker) else step.marker in code


def file_edit(path: str, steps: Sequence[Step], what: str = "") -> FileEdit:
    """A FileEdit made of steps; applying skips steps already present (idempotent)."""
    steps = tuple(steps)

    def apply(source: str) -> str:
        for st in steps:
            text = isinstance(st.marker, str)
            if text and st.marker not in source or not _step_applied(source, st):
                source = st.apply(source)
                # a text marker that appears only now took effect (no re-parse needed)
                if not (st.marker in source if text else _step_applied(source, st)):
                    raise AnchorError(f"step on {st.qualname or path} did not take effect")
        return source

    def is_applied(source: str) -> bool:
        return all(_step_applied(source, st) for st in steps)

    return FileEdit(path, apply, is_applied, what)


# ---------------------------------------------------------------- hooks


def hook_code(body: str, guard: str = "", imports: tuple[str, str] | None = None,
              package: str = "", orelse: str = "") -> str:
    """The code of one hook: ``if guard:`` (nothing when ``guard`` is ""), then
    ``from package.module import names`` (``imports`` = (module, names)) and ``body``;
    ``orelse``: the ``else:`` branch."""
    lines = []
    if imports is not None:
        module, names = imports
        lines += [f"from {package}.{module} import {names}"] + ([""] if guard else [])
    lines += textwrap.dedent(body).strip("\n").splitlines()
    if not guard:
        return "\n".join(lines) + "\n"
    code = f"if {guard}:\n" + "".join(f"    {x}\n" if x else "\n" for x in lines)
    if orelse:
        code += "else:\n" + "".join(f"    {x}\n" for x in
                                       textwrap.dedent(orelse).strip("\n").splitlines())
    return code


def hook(qualname: str, body: str, *, guard: str = "",
         imports: tuple[str, str] | None = None, package: str = "", orelse: str = "",
         at: Callable[[str], bool] | None = None, before: bool = False,
         replace: bool = False, marker: str | Callable[[str], bool] = "") -> Step:
    """A Step that writes one hook into ``qualname``: its code (hook_code) at the start
    of the function, or after (``before``: before; ``replace``: instead of) the one
    statement ``at`` selects.  Applied when ``marker`` (default: the body's first line)
    is in the function."""
    code = hook_code(body, guard, imports, package, orelse)
    if at is None:
        apply = functools.partial(insert_at_start, qualname=qualname, code=code)
    else:
        apply = functools.partial(insert_near, qualname=qualname, match=at, code=code,
                                  before=before, replace=replace)
    first = textwrap.dedent(body).strip("\n").splitlines()[0].strip()
    return Step(qualname, apply, marker or first)
