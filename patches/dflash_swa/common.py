"""Pieces both version families of dflash-swa share: the added module, the
DFlashProposer hooks (the V1 proposer file is the same in 0.20.x and 0.32/0.33 where
the hooks go), and a libcst helper that swaps an ``if`` statement for other code."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable

from ..framework import (AddedFile, AnchorError, Step, code_of, cst, edit_function, expr,
                         file_edit, insert_at_start, insert_near, m, statements)

PAYLOAD = Path(__file__).parent / "payload" / "dflash_swa.py"
MODULE = "vllm.v1.spec_decode.dflash_swa"
ADDED = (AddedFile("vllm/v1/spec_decode/dflash_swa.py", PAYLOAD.read_bytes,
                   "per-layer sliding windows and per-KV-cache-group DFlash drafting"),)

PROPOSER = "vllm/v1/spec_decode/dflash.py"
CLS = "DFlashProposer"
TAG = "dflash-swa"



def insert_code(source: str, qualname: str, code: str, *,
                match: Callable[[str], bool] | None = None, before: bool = False,
                replace: bool = False) -> str:
    """Insert ``code`` at the start of function ``qualname`` (``match`` None) or
    after / before / instead of its one simple statement whose code satisfies
    ``match``."""
    if match is None:
        return insert_at_start(source, qualname, code)
    return insert_near(source, qualname, match, code, before=before, replace=replace)


def add_methods(source: str, qualname: str, code: str) -> str:
    """Add functions right after ``qualname``, each after one blank line."""
    new = [s.with_changes(leading_lines=[cst.EmptyLine()] + [
        ln for ln in s.leading_lines if ln.comment is not None]) for s in statements(code)]
    return edit_function(source, qualname, lambda fn: cst.FlattenSentinel([fn] + new))


def replace_arg(source: str, qualname: str, matcher, new: str, where: str) -> str:
    """Replace the one argument expression of ``qualname`` matching ``matcher``."""
    def edit(fn):
        hits = m.findall(fn, m.Arg(value=matcher))
        if len(hits) != 1:
            raise AnchorError(f"argument {where} in {qualname} found {len(hits)} times "
                              "(need exactly 1)")
        target = hits[0]

        class Swap(cst.CSTTransformer):
            def leave_Arg(self, original, updated):
                return updated.with_changes(value=expr(new)) if original is target \
                    else updated

        return fn.visit(Swap())

    return edit_function(source, qualname, edit)


def replace_if(source: str, qualname: str, test: Callable[[str], bool], code: str,
               note: str) -> str:
    """Swap the one ``if`` statement of ``qualname`` whose condition satisfies ``test``
    for ``code`` (may be empty), with ``note`` as comment lines above what follows.
    The ``if``'s own comment lines go with it; blank lines before it stay."""
    new = statements(code) if code.strip() else []
    comments = [cst.EmptyLine(comment=cst.Comment(f"# {line}".rstrip()))
                for line in note.splitlines()]

    def edit(fn: cst.FunctionDef) -> cst.FunctionDef:
        hits = []

        class Find(cst.CSTVisitor):
            def visit_If(self, node: cst.If) -> None:
                if test(code_of(node.test)):
                    hits.append(node)

        fn.visit(Find())
        if len(hits) != 1:
            raise AnchorError(f"if-statement in {qualname} found {len(hits)} times "
                              "(need exactly 1)")
        target = hits[0]

        class Swap(cst.CSTTransformer):
            def leave_IndentedBlock(self, original, updated):
                body = list(updated.body)
                olds = list(original.body)
                if not any(s is target for s in olds):
                    return updated
                i = next(k for k, s in enumerate(olds) if s is target)
                blank = [ln for ln in target.leading_lines if ln.comment is None]
                repl = list(new)
                rest = body[i + 1:]
                if repl:
                    repl[0] = repl[0].with_changes(
                        leading_lines=blank + comments + list(repl[0].leading_lines))
                elif rest:
                    rest[0] = rest[0].with_changes(
                        leading_lines=blank + comments + list(rest[0].leading_lines))
                else:
                    raise AnchorError(f"nothing follows the if-statement in {qualname}")
                return updated.with_changes(body=body[:i] + repl + rest)

        return fn.visit(Swap())

    return edit_function(source, qualname, edit)


# ---------------------------------------------------------------- DFlashProposer hooks


def proposer_edit(two_sided_windows: bool):
    """Hooks in DFlashProposer (vllm/v1/spec_decode/dflash.py) for DFlashGroups."""
    init_code = (f"# {TAG}: per-KV-cache-group drafting state (initialize_attn_backend)\n"
                 "self.dflash_swa_runner = runner\n"
                 "self.dflash_groups = None\n")
    prepare_code = (f"if self.dflash_groups is not None:  # {TAG}: slots of every group\n"
                    "    self.dflash_groups.prepare(\n"
                    "        cad, num_context, num_query_total, num_query_per_req\n"
                    "    )\n")
    context_code = ("context_slots = self._context_slot_mapping_buffer[:num_context]\n"
                    f"if self.dflash_groups is not None:  # {TAG}: one per draft layer\n"
                    "    context_slots = self.dflash_groups.context_slots(num_context)\n")
    metadata_code = (f"if self.dflash_groups is not None:  # {TAG}: one per group\n"
                     "    return self.dflash_groups.build_attn_metadata(cad, draft_index)\n")
    init_attn = f'''
@override
def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None) -> None:
    """{TAG}: draft layers may span several KV cache groups (sliding + full
    attention); see {MODULE}."""
    from {MODULE} import DFlashGroups

    self.dflash_groups = DFlashGroups.setup(
        self,
        kv_cache_config,
        kernel_block_sizes,
        super().initialize_attn_backend,
        two_sided_windows={two_sided_windows!r},
    )
'''
    slot_mapping = f'''
@override
def _get_slot_mapping(self, num_tokens, slot_mapping=None):
    if self.dflash_groups is None:
        return super()._get_slot_mapping(num_tokens, slot_mapping)
    return self.dflash_groups.slot_mapping(num_tokens)  # {TAG}: one per group
'''
    build = f"{CLS}.build_model_inputs_first_pass"

    def context_slots(source: str) -> str:
        source = insert_code(
            source, build, context_code, before=True,
            match=lambda c: "self.model.precompute_and_store_context_kv(" in c)
        return replace_arg(source, build, m.Subscript(value=m.Attribute(
            value=m.Name("self"), attr=m.Name("_context_slot_mapping_buffer"))),
            "context_slots", "self._context_slot_mapping_buffer[...]")

    return file_edit(PROPOSER, [
        Step(f"{CLS}.__init__", partial(insert_code, qualname=f"{CLS}.__init__",
                                        code=init_code), "self.dflash_swa_runner = runner"),
        Step(f"{CLS}.set_inputs_first_pass", partial(
            insert_code, qualname=f"{CLS}.set_inputs_first_pass",
            match=lambda c: c.strip() == "query_slot_mapping = "
                                         "self._slot_mapping_buffer[:num_query_total]",
            code=prepare_code), "self.dflash_groups.prepare("),
        Step(build, context_slots, "self.dflash_groups.context_slots(num_context)"),
        Step(f"{CLS}.build_per_group_and_layer_attn_metadata", partial(
            insert_code, qualname=f"{CLS}.build_per_group_and_layer_attn_metadata",
            code=metadata_code), "self.dflash_groups.build_attn_metadata("),
        Step(f"{CLS}.initialize_attn_backend", partial(
            add_methods, qualname=f"{CLS}.build_per_group_and_layer_attn_metadata",
            code=init_attn), "DFlashGroups.setup("),
        Step(f"{CLS}._get_slot_mapping", partial(
            add_methods, qualname=f"{CLS}.initialize_attn_backend",
            code=slot_mapping), "self.dflash_groups.slot_mapping(num_tokens)"),
    ], "DFlashProposer: one block table / slot mapping / causality per KV cache group")
