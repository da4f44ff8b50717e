"""Corpus and tokenizer of the real pair: Python source every machine has.

Files: every ``.py`` under the interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``, without site-/dist-packages), optionally the
``.py`` files of its site-packages (``purelib``/``platlib``); sorted by relative path,
files over ``max_file_bytes`` or not UTF-8 dropped, then split by file with a seeded
shuffle into train and held-out.  The list (relative paths, sizes, split) is written
to corpus.json so a result says what it was trained and measured on.

Tokenizer: byte-level BPE (HF ``tokenizers``) trained on the train split, saved as
tokenizer.json + tokenizer_config.json (PreTrainedTokenizerFast) next to the target.
Byte-level BPE rather than raw bytes: ~3.5 bytes per token on Python code, so the
same model and sequence length see 3-4x more context, and drafts span whole
identifiers (a realistic draft-length profile).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sysconfig
from pathlib import Path

BOS, EOS, MASK = "<|bos|>", "<|endoftext|>", "<|mask|>"
SPECIALS = [BOS, EOS, MASK]  # ids 0, 1, 2


def source_roots(site_packages: bool) -> list[tuple[str, Path]]:
    paths = sysconfig.get_paths()
    roots = [("stdlib", Path(paths["stdlib"]))]
    if site_packages:
        for key in ("purelib", "platlib"):
            p = Path(paths[key])
            if p.is_dir() and all(p != r for _, r in roots):
                roots.append((key, p))
    return roots


def list_files(site_packages: bool = False, max_file_bytes: int = 400_000,
               max_files: int | None = None, max_site_bytes: int | None = None) -> list[dict]:
    """Sorted .py files: [{"root", "path", "bytes"}].  Site-packages files (if asked
    for) are thinned to an even spread of at most max_site_bytes."""
    out = []
    for name, root in source_roots(site_packages):
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames
                                 if name != "stdlib" or d not in ("site-packages",
                                                                   "dist-packages"))
            for fn in sorted(filenames):
                if not fn.endswith(".py"):
                    continue
                p = Path(dirpath) / fn
                try:
                    size = p.stat().st_size
                except OSError:
                    continue
                if 0 < size <= max_file_bytes:
                    out.append({"root": name, "path": str(p.relative_to(root)),
                                "bytes": size, "_abs": str(p)})
    out.sort(key=lambda f: (f["root"] != "stdlib", f["root"], f["path"]))
    site = [f for f in out if f["root"] != "stdlib"]
    total = sum(f["bytes"] for f in site)
    if max_site_bytes is not None and total > max_site_bytes:
        keep = set(range(0, len(site), -(-total // max_site_bytes)))
        out = [f for f in out if f["root"] == "stdlib"] + \
            [f for i, f in enumerate(site) if i in keep]
    if max_files is not None and len(out) > max_files:
        # an even spread over the sorted list (deterministic), not the first N
        step = len(out) / max_files
        out = [out[int(i * step)] for i in range(max_files)]
    return out


def read_text(f: dict) -> str | None:
    try:
        with open(f["_abs"], "rb") as fh:
            return fh.read().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def split_files(files: list[dict], heldout_frac: float, seed: int) -> None:
    """Adds f["split"] in place: "heldout" for a seeded heldout_frac of the files."""
    order = list(range(len(files)))
    random.Random(seed).shuffle(order)
    n_held = max(1, round(len(files) * heldout_frac))
    held = set(order[:n_held])
    for i, f in enumerate(files):
        f["split"] = "heldout" if i in held else "train"


def load_corpus(site_packages: bool, heldout_frac: float, seed: int,
                max_file_bytes: int, max_files: int | None,
                max_site_bytes: int | None = None):
    """(texts by split, file list for corpus.json)."""
    files = list_files(site_packages, max_file_bytes, max_files, max_site_bytes)
    texts = {"train": [], "heldout": []}
    kept = []
    for f in files:
        t = read_text(f)
        if t is None or not t.strip():
            continue
        f["text"] = t
        kept.append(f)
    split_files(kept, heldout_frac, seed)
    for f in kept:
        texts[f["split"]].append(f.pop("text"))
        f.pop("_abs")
    return texts, kept


def corpus_record(files: list[dict], site_packages: bool, seed: int,
                  heldout_frac: float) -> dict:
    import platform
    import sys

    listing = "\n".join(f"{f['root']}/{f['path']}\t{f['bytes']}\t{f['split']}"
                        for f in files)
    return {
        "python": sys.version.split()[0], "implementation": platform.python_implementation(),
        "roots": {n: str(p) for n, p in source_roots(site_packages)},
        "site_packages": site_packages, "seed": seed, "heldout_frac": heldout_frac,
        "files": len(files),
        "bytes": {s: sum(f["bytes"] for f in files if f["split"] == s)
                  for s in ("train", "heldout")},
        "list_sha256": hashlib.sha256(listing.encode()).hexdigest(),
        "list": listing.split("\n"),
    }


def train_tokenizer(texts: list[str], vocab_size: int, max_bytes: int | None = None,
                    seed: int = 0):
    """Byte-level BPE on (a seeded sample of at most max_bytes of) the train texts;
    the specials get ids 0-2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    if max_bytes is not None:
        sel, n = [], 0
        order = list(range(len(texts)))
        random.Random(seed).shuffle(order)
        for t in (texts[i] for i in order):
            if n >= max_bytes:
                break
            sel.append(t)
            n += len(t)
        texts = sel
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def save_tokenizer(tok, out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json (what vLLM / AutoTokenizer load)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   unk_token=None, pad_token=EOS,
                                   additional_special_tokens=[MASK])
    fast.model_max_length = 1 << 20
    fast.save_pretrained(str(out_dir))


def encode_stream(tok, texts: list[str]):
    """One int32 tensor: every text's ids followed by EOS (document separator), plus
    the start offset of each text."""
    import numpy as np
    import torch

    eos = tok.token_to_id(EOS)
    encs = tok.encode_batch(texts)
    starts, parts, n = [], [], 0
    for e in encs:
        ids = np.asarray(e.ids, dtype=np.int32)
        starts.append(n)
        parts.append(ids)
        parts.append(np.asarray([eos], dtype=np.int32))
        n += len(ids) + 1
    stream = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return torch.from_numpy(stream), starts


def dump(path: Path, obj) -> None:
    tmp = str(path) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
