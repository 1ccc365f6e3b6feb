"""Check 4: tensors of excluded layers byte-identical to the source, by MD5 of their payloads.

Each pair is streamed over its exact byte range in fixed-size chunks (constant memory per
worker). While the two sides agree only the source is hashed and the output chunk is compared
with ``==`` (a memcmp): identical bytes have identical MD5s, so hashing both sides would
double the CPU cost for nothing. From the first differing chunk on, a copy of the shared
hash state continues over the output's bytes, so both reported digests are exact. ``hashlib``
and file reads release the GIL, so a thread pool spreads pairs across cores and disks.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
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
ALIGN = 4096  # O_DIRECT offset, length and buffer alignment
DIRECT_IO_MIN_BYTES = 1 << 30  # below this the page cache likely holds the data already
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


def digest_pair(src: TensorInfo, out: TensorInfo, chunk_bytes: int = CHUNK_BYTES,
                direct: bool = False) -> PairDigest:
    """MD5 both payloads in one pass; see the module docstring for why one side is hashed."""
    size = src.nbytes
    chunk = max(1, min(chunk_bytes, size))
    n_chunks = -(-size // chunk)
    slots = 2 if n_chunks > 1 else 1
    with _RangeReader(src, chunk, slots, direct) as rs, _RangeReader(out, chunk, slots, direct) as ro:

        def load(k: int):
            offset = k * chunk
            n = min(chunk, size - offset)
            return rs.read(k % slots, offset, n), ro.read(k % slots, offset, n)

        if n_chunks <= 1:
            return _digest_chunks(src.name, size, [load(0)] if n_chunks else [])
        # A reader thread fetches chunk k+1 into the other buffer slot while chunk k is hashed,
        # so disk time and hashing overlap instead of adding up.
        with ThreadPoolExecutor(max_workers=1) as reader:
            return _digest_chunks(src.name, size, _prefetched(reader, load, n_chunks))


class _RangeReader:
    """Reads one tensor's payload in chunks into reusable buffers (constant memory).

    Buffered reads return exact-size ``bytearray`` chunks. With ``direct`` the file is opened
    ``O_DIRECT``: page-aligned blocks are read into page-aligned ``mmap`` buffers, bypassing the
    page cache, which saves the kernel's copy and cache upkeep (much of the CPU a cold read
    costs) and leaves the cache to the user's other work.
    """

    def __init__(self, info: TensorInfo, chunk: int, slots: int, direct: bool):
        self.info, self.direct = info, direct and hasattr(os, "O_DIRECT")
        self.fd = os.open(info.file, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        if self.direct:
            self.buffers = [mmap.mmap(-1, chunk + 2 * ALIGN) for _ in range(slots)]
        else:
            self.buffers = [bytearray(chunk) for _ in range(slots)]
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fd, info.start, info.nbytes, os.POSIX_FADV_SEQUENTIAL)

    def __enter__(self) -> _RangeReader:
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)

    def read(self, slot: int, offset: int, n: int):
        if self.direct:
            return self._read_direct(self.buffers[slot], self.info.start + offset, n)
        buf = self.buffers[slot]
        view = memoryview(buf)[:n]
        self._fill(view, self.info.start + offset, n, n)
        # A full-size bytearray compares with one memcmp; a short tail is copied once.
        return buf if n == len(buf) else bytes(view)

    def _read_direct(self, buf: mmap.mmap, position: int, n: int) -> memoryview:
        aligned = position - position % ALIGN
        delta = position - aligned
        length = -(-(delta + n) // ALIGN) * ALIGN
        view = memoryview(buf)[:length]
        self._fill(view, aligned, delta + n, length)
        return view[delta : delta + n]

    def _fill(self, view: memoryview, position: int, need: int, request: int) -> None:
        got = 0
        while got < need:
            k = os.preadv(self.fd, [view[got:request]], position + got)
            if k == 0 or (self.direct and k % ALIGN and got + k < need):
                raise EOFError(f"{self.info.file} ends before the end of tensor {self.info.name!r}")
            got += k


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
        if diverged is None and not _same(a, b):
            diverged = shared.copy()
            first_diff = done + _first_difference(a, b)
        shared.update(a)
        if diverged is not None:
            diverged.update(b)
        done += len(a)
    source_md5 = shared.hexdigest()
    return PairDigest(name, size, source_md5, diverged.hexdigest() if diverged else source_md5, first_diff)


def _same(a, b) -> bool:
    # bytearray/bytes equality is one memcmp; memoryview equality compares item by item (~40x
    # slower), so an aligned O_DIRECT view is copied once into a bytearray first.
    if isinstance(a, memoryview):
        a = bytearray(a)
    return a == b


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


def _safe_digest(src: TensorInfo, out: TensorInfo, direct: bool) -> PairDigest:
    try:
        try:
            return digest_pair(src, out, direct=direct)
        except OSError as exc:
            if not (direct and exc.errno == errno.EINVAL):
                raise
            return digest_pair(src, out, direct=False)  # a filesystem without O_DIRECT (tmpfs)
    except (OSError, EOFError) as exc:
        return PairDigest(src.name, src.nbytes, "", "", None, error=str(exc))


def check_md5(source: dict[str, TensorInfo], output: dict[str, TensorInfo], exclude: list[str], *,
              tied_embeddings: bool = False, max_samples: int | None = None, seed: int = 0,
              workers: int | None = None, progress: Progress | None = None,
              direct_io: bool | None = None) -> CheckResult:
    """Compare the excluded tensors; ``direct_io`` None reads ``O_DIRECT`` from 1 GiB of payload up."""
    result = CheckResult("md5")
    candidates = excluded_candidates(source, exclude, tied_embeddings)
    if not candidates:
        result.skipped_reason = ("no tensor is excluded from quantization" if not exclude else
                                 f"no source tensor matches the exclusions {exclude}")
        return result
    checked = sample(candidates, max_samples, seed)
    pairs, result.findings = _comparable_pairs(checked, source, output)
    t0 = time.perf_counter()
    if direct_io is None:
        direct_io = sum(s.nbytes for s, _ in pairs) >= DIRECT_IO_MIN_BYTES
    digests = _digest_all(pairs, workers or default_workers(), progress, direct_io)
    result.findings += [f for d in digests if (f := _finding(d, source[d.name], output[d.name]))]
    total = sum(d.nbytes for d in digests)
    result.stats.update(candidates=len(candidates), checked=len(checked), bytes_hashed=total,
                        identical=sum(d.identical for d in digests))
    result.stats["sampled"] = len(checked) < len(candidates)
    result.stats["seed"] = seed
    result.stats["direct_io"] = direct_io
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


def _digest_all(pairs: list[tuple[TensorInfo, TensorInfo]], workers: int, progress: Progress | None,
                direct: bool):
    # Largest first, so one big tensor does not start last and leave the other workers idle.
    pairs = sorted(pairs, key=lambda p: -p[0].nbytes)
    total = sum(s.nbytes for s, _ in pairs)
    done = 0
    digests = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for digest in pool.map(lambda p: _safe_digest(*p, direct), pairs):
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
