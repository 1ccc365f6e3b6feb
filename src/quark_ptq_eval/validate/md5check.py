"""Check 4: tensors of excluded layers byte-identical to the source, by MD5 of their payloads.

Each pair is streamed over its exact byte range in fixed-size chunks (constant memory per
worker). While the two sides agree only the source is hashed and the output chunk is compared
with ``==`` (a memcmp): identical bytes have identical MD5s, so hashing both sides would
double the CPU cost for nothing. From the first differing chunk on, a copy of the shared
hash state continues over the output's bytes, so both reported digests are exact. ``hashlib``
and file reads release the GIL, so a thread pool spreads pairs across cores and disks.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..safetensors_io import TensorInfo
from .expectations import matches
from .report import CheckResult, Finding

CHUNK_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_WORKERS = 4
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class PairDigest:
    name: str
    nbytes: int
    source_md5: str
    output_md5: str
    first_difference: int | None  # byte offset inside the payload; None when identical
    error: str | None = None

    @property
    def identical(self) -> bool:
        return self.error is None and self.first_difference is None


def default_workers() -> int:
    return max(1, min(DEFAULT_MAX_WORKERS, os.cpu_count() or 1))


def excluded_candidates(source: dict[str, TensorInfo], exclude: list[str], tied_embeddings: bool) -> list[str]:
    """Source tensors of excluded modules; a tied ``lm_head`` lives in the embedding's bytes."""
    names = {n for n in source if matches(n.rpartition(".")[0], n, exclude)}
    if tied_embeddings and matches("lm_head", "lm_head.weight", exclude):
        names |= {n for n in source if n.endswith("embed_tokens.weight")}
    return sorted(names)


def sample(candidates: list[str], max_samples: int | None, seed: int) -> list[str]:
    """Seeded spot-check (the same draw as Quark's helper for the same seed)."""
    if max_samples is None or len(candidates) <= max_samples:
        return list(candidates)
    return sorted(random.Random(seed).sample(candidates, max_samples))


def digest_pair(src: TensorInfo, out: TensorInfo, chunk_bytes: int = CHUNK_BYTES) -> PairDigest:
    """MD5 both payloads in one pass; see the module docstring for why one side is hashed."""
    size = src.nbytes
    chunk = max(1, min(chunk_bytes, size))
    n_chunks = -(-size // chunk)
    with open(src.file, "rb", buffering=0) as fs, open(out.file, "rb", buffering=0) as fo:
        _advise_sequential(fs, src.start, size)
        _advise_sequential(fo, out.start, size)
        buffers = [(bytearray(chunk), bytearray(chunk)) for _ in range(2 if n_chunks > 1 else 1)]

        def load(k: int) -> tuple[bytearray | bytes, bytearray | bytes]:
            offset, (a, b) = k * chunk, buffers[k % len(buffers)]
            n = min(chunk, size - offset)
            return _read_exact(fs, a, src.start + offset, n), _read_exact(fo, b, out.start + offset, n)

        if n_chunks <= 1:
            return _digest_chunks(src.name, size, [load(0)] if n_chunks else [])
        # A reader thread fetches chunk k+1 into the other buffer pair while chunk k is hashed,
        # so disk time and hashing overlap instead of adding up.
        with ThreadPoolExecutor(max_workers=1) as reader:
            return _digest_chunks(src.name, size, _prefetched(reader, load, n_chunks))


def _prefetched(reader: ThreadPoolExecutor, load, n_chunks: int):
    pending = reader.submit(load, 0)
    for k in range(n_chunks):
        pair = pending.result()
        if k + 1 < n_chunks:
            pending = reader.submit(load, k + 1)
        yield pair


def _digest_chunks(name: str, size: int, chunks) -> PairDigest:
    shared = hashlib.md5()
    diverged = None  # the output's own hash state, from the first differing chunk on
    first_diff: int | None = None
    done = 0
    for a, b in chunks:
        if diverged is None and a != b:
            diverged = shared.copy()
            first_diff = done + _first_difference(a, b)
        shared.update(a)
        if diverged is not None:
            diverged.update(b)
        done += len(a)
    source_md5 = shared.hexdigest()
    return PairDigest(name, size, source_md5, diverged.hexdigest() if diverged else source_md5, first_diff)


def _read_exact(fh, buf: bytearray, offset: int, n: int) -> bytearray | bytes:
    view = memoryview(buf)[:n]
    got = 0
    while got < n:
        k = os.preadv(fh.fileno(), [view[got:]], offset + got)
        if k == 0:
            raise EOFError(f"{fh.name} ends {n - got} bytes before the tensor's end")
        got += k
    # A full-size bytearray compares with one memcmp; a short tail is sliced once.
    return buf if n == len(buf) else bytes(view)


def _first_difference(a, b) -> int:
    lo, hi = 0, len(a)
    va, vb = memoryview(a), memoryview(b)
    while hi - lo > 1:  # invariant: the first difference lies in [lo, hi)
        mid = (lo + hi) // 2
        if bytes(va[lo:mid]) == bytes(vb[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo


def _advise_sequential(fh, offset: int, length: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fh.fileno(), offset, length, os.POSIX_FADV_SEQUENTIAL)


def _safe_digest(src: TensorInfo, out: TensorInfo) -> PairDigest:
    try:
        return digest_pair(src, out)
    except (OSError, EOFError) as exc:
        return PairDigest(src.name, src.nbytes, "", "", None, error=str(exc))


def check_md5(source: dict[str, TensorInfo], output: dict[str, TensorInfo], exclude: list[str], *,
              tied_embeddings: bool = False, max_samples: int | None = None, seed: int = 0,
              workers: int | None = None, progress: Progress | None = None) -> CheckResult:
    result = CheckResult("md5")
    candidates = excluded_candidates(source, exclude, tied_embeddings)
    if not candidates:
        result.skipped_reason = ("no tensor is excluded from quantization" if not exclude else
                                 f"no source tensor matches the exclusions {exclude}")
        return result
    checked = sample(candidates, max_samples, seed)
    pairs, result.findings = _comparable_pairs(checked, source, output)
    t0 = time.perf_counter()
    digests = _digest_all(pairs, workers or default_workers(), progress)
    result.findings += [f for d in digests if (f := _finding(d, source[d.name], output[d.name]))]
    total = sum(d.nbytes for d in digests)
    result.stats.update(candidates=len(candidates), checked=len(checked), bytes_hashed=total,
                        identical=sum(d.identical for d in digests))
    result.stats["sampled"] = len(checked) < len(candidates)
    result.stats["seed"] = seed
    result.stats["digests"] = {d.name: d.source_md5 for d in digests if d.identical}
    result.seconds = time.perf_counter() - t0
    return result


def _comparable_pairs(names: list[str], source: dict[str, TensorInfo], output: dict[str, TensorInfo]):
    pairs, findings = [], []
    for name in names:
        s, o = source[name], output.get(name)
        if o is None:
            findings.append(Finding(name, "is excluded from quantization but missing from the output.", side="quark"))
        elif (s.dtype, s.shape) != (o.dtype, o.shape):
            side = "environment" if s.shape == o.shape else "quark"
            findings.append(Finding(name, f"is excluded but its header changed from {s.dtype} {list(s.shape)} "
                                          f"to {o.dtype} {list(o.shape)}.", side=side,
                                    evidence="same shape, other dtype: loaded in another dtype"
                                    if side == "environment" else ""))
        else:
            pairs.append((s, o))
    return pairs, findings


def _digest_all(pairs: list[tuple[TensorInfo, TensorInfo]], workers: int, progress: Progress | None):
    # Largest first, so one big tensor does not start last and leave the other workers idle.
    pairs = sorted(pairs, key=lambda p: -p[0].nbytes)
    total = sum(s.nbytes for s, _ in pairs)
    done = 0
    digests = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for digest in pool.map(lambda p: _safe_digest(*p), pairs):
            digests.append(digest)
            done += digest.nbytes
            if progress:
                progress("md5", done, total)
    return sorted(digests, key=lambda d: d.name)


def _finding(d: PairDigest, src: TensorInfo, out: TensorInfo) -> Finding | None:
    if d.error:
        return Finding(d.name, f"could not be read: {d.error}.", side="environment",
                       evidence=f"source {src.file.name}, output {out.file.name}")
    if d.first_difference is None:
        return None
    return Finding(d.name, f"is excluded from quantization but its payload differs from the source "
                           f"from byte {d.first_difference} of {d.nbytes}.", side="quark",
                   evidence=f"MD5 source {d.source_md5} != output {d.output_md5}; same dtype and shape, "
                            "so the export or an algorithm rewrote an excluded layer")
