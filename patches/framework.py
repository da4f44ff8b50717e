"""The transform framework: what a versioned transform declares, and libcst helpers.

A ``Transform`` (one package under ``patches/``) maps version families to a ``Family``:
the file edits (libcst codemods) and added files for those versions, or ``upstream=True``
when the release already contains the change (its edits' detectors must then hold and
nothing is written).  Every helper fails closed: an anchor that is not found exactly
once raises ``AnchorError`` and the engine writes nothing.
"""

from __future__ import annotations

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


def parse(source: str) -> cst.Module:
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


def function_code(source: str, qualname: str) -> str | None:
    """Source of one function, or None when it is not there exactly once."""
    module = parse(source)
    try:
        return module.code_for_node(find_function(module, qualname))
    except AnchorError:
        return None


def edit_function(source: str, qualname: str,
                  edit: Callable[[cst.FunctionDef], cst.FunctionDef]) -> str:
    module = parse(source)
    target = find_function(module, qualname)
    new = edit(target)

    class Swap(cst.CSTTransformer):
        def leave_FunctionDef(self, original, updated):
            return new if original is target else updated

    return module.visit(Swap()).code


def replace_one(node: cst.CSTNode, matcher, replacement: cst.CSTNode, where: str = ""):
    """Replace the single node matching ``matcher`` inside ``node``."""
    hits = m.findall(node, matcher)
    if len(hits) != 1:
        raise AnchorError(f"anchor {where or matcher} found {len(hits)} times (need exactly 1)")
    return m.replace(node, matcher, replacement)


def expr(code: str) -> cst.BaseExpression:
    return cst.parse_expression(code)


def stmt(code: str) -> cst.BaseStatement:
    return cst.parse_statement(code)
