"""The verify suite, run inside a fresh interpreter of the target environment.

Started by ``ddtree_patcher.verify_client`` as ``python -m ddtree_verify.runner SPEC``
from a temporary copy of this package (the target env need not have ddtree-patch).
It imports the *patched vLLM* and the DDTree core copied into it, so it checks what
will serve.  Prints one line ``DDTREE-VERIFY <json>``: a list of checks with name,
status (passed / failed / skipped), seconds, message.
"""

import importlib
import json
import sys
import time
import traceback

from . import integrity


class Skipped(Exception):
    """The check does not apply here (the message says why); never counted as passed."""


def check_imports(spec):
    mods = []
    for rel in sorted(spec["files"]):
        if rel.endswith(".py"):
            mod = rel[:-3].replace("/", ".")
            if mod.endswith(".__init__"):
                mod = mod[: -len(".__init__")]
            mods.append(mod)
    for mod in mods:
        importlib.import_module(mod)
    extra = ""
    if "ddtree-proposer" in spec["applied"]:
        import typing

        from vllm.config import speculative

        if "ddtree" not in typing.get_args(_flatten(speculative.SpeculativeMethod)):
            return False, "method 'ddtree' is not registered in SpeculativeConfig"
        extra = "; method 'ddtree' registered"
    return True, f"{len(mods)} patched modules import{extra}"


def _flatten(lit):
    """Literal[...] with nested Literals -> one Literal of all values."""
    import typing

    vals = []
    for a in typing.get_args(lit):
        if typing.get_origin(a) is typing.Literal:
            vals += typing.get_args(_flatten(a))
        else:
            vals.append(a)
    return typing.Literal[tuple(vals)]


def check_kernels(spec):
    from . import kernels

    if "ddtree-proposer" not in spec["applied"]:
        raise Skipped("DDTree is not applied")
    core = importlib.import_module("vllm.v1.spec_decode.ddtree.core")
    return kernels.run(core, seed=spec.get("seed"), oracle=kernels.load_oracle(core))


def check_engine(spec):
    from . import engine_check

    if "ddtree-sampler" not in spec["applied"]:
        raise Skipped("DDTree is not applied")
    return engine_check.run(spec)


CHECKS = {"integrity": integrity.check, "imports": check_imports,
          "kernels": check_kernels, "engine": check_engine}


def main(argv):
    with open(argv[1]) as f:
        spec = json.load(f)
    sys.path.insert(0, spec["site"])
    results = []
    for name in spec["checks"]:
        t0 = time.perf_counter()
        try:
            ok, msg = CHECKS[name](spec)
            status = "passed" if ok else "failed"
        except Skipped as why:
            status, msg = "skipped", f"skipped: {why}"
        except Exception as exc:  # a check that raises fails, with the reason
            status, msg = "failed", f"{type(exc).__name__}: {exc}"
            where = traceback.extract_tb(exc.__traceback__)[-1]
            msg += f" (at {where.filename.rsplit('/', 1)[-1]}:{where.lineno})"
        results.append({"check": name, "status": status,
                        "seconds": round(time.perf_counter() - t0, 2), "message": msg})
        if status == "failed" and name in ("integrity", "imports"):
            rest = spec["checks"][spec["checks"].index(name) + 1:]
            results += [{"check": n, "status": "skipped", "seconds": 0.0,
                         "message": f"skipped: {name} failed (running broken files proves "
                         "nothing more)"} for n in rest]
            break
    print("DDTREE-VERIFY " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(sys.argv)
