"""Byte identity of tensors that must not change, with Quark-compatible MD5s as evidence.

Each pair is streamed over its exact byte range in fixed-size mapped windows (bounded memory
per worker) and compared with ``memcmp``: equal bytes need no hash, and memcmp runs at memory
speed where MD5 runs at a few hundred MB/s per core, so the check keeps up with the disk. Only
a pair that differs is hashed (both sides, exact MD5s for the report, the digests Quark's own
validator would print). ``memcmp`` (through ctypes) releases the GIL, so a thread pool spreads
pairs across cores. :func:`digest_pair` hashes while comparing, for callers that want digests.
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from quark_ptq_eval.base.safetensors_io import TensorInfo
from quark_ptq_eval.validate.expectations import matches
from quark_ptq_eval.validate.report import CheckResult, Finding
from quark_ptq_eval.validate.widening import header_change, is_lossless_widening, widening_note

CHUNK_BYTES = 16 * 1024 * 1024  # one mapped window per side
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
    chunk = max(1, chunk_bytes)
    with _Payload(src, chunk) as a, _Payload(out, chunk) as b:
        return _digest_chunks(src.name, src.nbytes, zip(a.chunks(), b.chunks(), strict=True))


def compare_pair(src: TensorInfo, out: TensorInfo, chunk_bytes: int = CHUNK_BYTES) -> PairDigest:
    """memcmp both payloads window by window; hash both (exactly) only if they differ."""
    chunk = max(1, chunk_bytes)
    with _Payload(src, chunk) as a, _Payload(out, chunk) as b:
        same = all(_same(x, y) for x, y in zip(a.chunks(), b.chunks(), strict=True))
    if same:
        return PairDigest(src.name, src.nbytes, "", "", None)
    return digest_pair(src, out, chunk_bytes)


class _Payload:
    """One tensor's payload as a sequence of chunks read straight from the page cache.

    Each chunk is a private, read-only-in-practice ``mmap`` window: hashing and comparing it
    touch the kernel's cached pages directly, with no copy into a user buffer (a copy costs
    as much CPU as a third of the MD5 itself). The next window is announced with
    ``POSIX_FADV_WILLNEED`` so the kernel reads it ahead while this one is hashed. Windows are
    unmapped as soon as they are done: memory stays bounded by the window size.
    """

    def __init__(self, info: TensorInfo, window: int):
        self.info, self.window = info, window
        self.fd = os.open(info.file, os.O_RDONLY)
        if os.fstat(self.fd).st_size < info.end:  # mapping past EOF would raise SIGBUS on access
            os.close(self.fd)
            raise EOFError(f"{info.file} ends before the end of tensor {info.name!r}")

    def __enter__(self) -> _Payload:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def chunks(self) -> Iterator[_Window]:
        self._read_ahead(self.info.start, min(self.window, self.info.nbytes))
        for offset in range(0, self.info.nbytes, self.window):
            start = self.info.start + offset
            n = min(self.window, self.info.nbytes - offset)
            self._read_ahead(start + n, min(self.window, self.info.end - start - n))
            aligned = start - start % mmap.ALLOCATIONGRANULARITY
            mm = mmap.mmap(self.fd, start - aligned + n, access=mmap.ACCESS_COPY, offset=aligned)
            view = memoryview(mm)
            window = _Window(view[start - aligned:], _address(mm) + start - aligned)
            try:
                yield window
            finally:  # every view of the window must be released before the unmap
                window.view.release()
                view.release()
                mm.close()

    def _read_ahead(self, position: int, length: int) -> None:
        if length > 0 and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, position, length, os.POSIX_FADV_WILLNEED)


class _Window:
    """A mapped chunk: its bytes (for hashing) and its address (for a GIL-free memcmp)."""

    def __init__(self, view: memoryview, address: int):
        self.view, self.address = view, address

    def __len__(self) -> int:
        return len(self.view)


def _address(mm: mmap.mmap) -> int:
    import ctypes  # only when tensors are compared: keeps CLI start-up light

    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


@functools.cache
def _memcmp() -> Callable[[int, int, int], int] | None:
    """libc's ``memcmp``, or None where the C library cannot be loaded this way."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
    except (OSError, TypeError):
        return None
    libc.memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    libc.memcmp.restype = ctypes.c_int
    return libc.memcmp


def _same(a: _Window, b: _Window) -> bool:
    memcmp = _memcmp()
    if memcmp is None:  # bytearray equality is a memcmp too, after one copy of each side
        return bytearray(a.view) == bytearray(b.view)
    return len(a) == len(b) and memcmp(a.address, b.address, len(a)) == 0


def _digest_chunks(name: str, size: int, chunks: Iterable[tuple[_Window, _Window]]) -> PairDigest:
    shared = hashlib.md5()
    diverged = None  # the output's own hash state, from the first differing chunk on
    first_diff: int | None = None
    done = 0
    for a, b in chunks:
        if diverged is None and not _same(a, b):
            diverged = shared.copy()
            first_diff = done + _first_difference(a.view, b.view)
        shared.update(a.view)
        if diverged is not None:
            diverged.update(b.view)
        done += len(a)
    source_md5 = shared.hexdigest()
    return PairDigest(name, size, source_md5, diverged.hexdigest() if diverged else source_md5, first_diff)


def _first_difference(a: memoryview, b: memoryview) -> int:
    lo, hi = 0, len(a)
    va, vb = memoryview(a), memoryview(b)
    while hi - lo > 1:  # invariant: the first difference lies in [lo, hi)
        mid = (lo + hi) // 2
        if bytes(va[lo:mid]) == bytes(vb[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo


def _safe_digest(src: TensorInfo, out: TensorInfo) -> PairDigest:
    try:
        return compare_pair(src, out)
    except (OSError, EOFError, ValueError) as exc:
        return PairDigest(src.name, src.nbytes, "", "", None, error=str(exc))


@dataclass(frozen=True)
class Sampling:
    """How many tensors to compare (``max_samples``, drawn with ``seed``; None: all), on how many
    threads, reporting bytes compared to ``progress``."""

    max_samples: int | None = None
    seed: int = 0
    workers: int | None = None
    progress: Progress | None = None


def check_excluded_bytes(source: dict[str, TensorInfo], output: dict[str, TensorInfo], exclude: list[str], *,
              tied_embeddings: bool = False, sampling: Sampling | None = None) -> CheckResult:
    """Byte identity of the excluded tensors only (what Quark's own MD5 helper checks)."""
    candidates = excluded_candidates(source, exclude, tied_embeddings)
    if not candidates:
        result = CheckResult("md5")
        result.skipped_reason = ("no tensor is excluded from quantization" if not exclude else
                                 f"no source tensor matches the exclusions {exclude}")
        return result
    return compare_tensors(source, output, candidates, sampling=sampling)


def compare_tensors(source: dict[str, TensorInfo], output: dict[str, TensorInfo], candidates: list[str], *,
                    sampling: Sampling | None = None, result: CheckResult | None = None) -> CheckResult:
    """Compare ``candidates`` (source names) byte for byte; one finding per missing or differing tensor."""
    result = result or CheckResult("md5")
    sampling = sampling or Sampling()
    seed, progress = sampling.seed, sampling.progress
    checked = sample(candidates, sampling.max_samples, seed)
    pairs, findings = _comparable_pairs(checked, source, output)
    result.findings += findings
    t0 = time.perf_counter()
    digests = _digest_all(pairs, sampling.workers or default_workers(), progress)
    result.findings += [f for d in digests if (f := _finding(d, source[d.name], output[d.name]))]
    result.stats.update(candidates=len(candidates), checked=len(checked),
                        bytes_compared=sum(d.nbytes for d in digests) * 2, identical=sum(d.identical for d in digests))
    result.stats["sampled"] = len(checked) < len(candidates)
    result.stats["seed"] = seed
    result.stats["checked_names"] = checked
    result.stats["differing_md5"] = {d.name: [d.source_md5, d.output_md5] for d in digests if not d.identical}
    result.seconds = time.perf_counter() - t0
    return result


def _comparable_pairs(names: list[str], source: dict[str, TensorInfo],
                      output: dict[str, TensorInfo]) -> tuple[list[tuple[TensorInfo, TensorInfo]], list[Finding]]:
    pairs: list[tuple[TensorInfo, TensorInfo]] = []
    findings: list[Finding] = []
    for name in names:
        s, o = source[name], output.get(name)
        if o is None:
            findings.append(Finding(name, "must be carried over unchanged but is missing from the output.",
                                    side="quark", evidence=f"expected: {s.dtype} {list(s.shape)} as in the source; "
                                                           "found: no such tensor"))
        elif (s.dtype, s.shape) != (o.dtype, o.shape) and is_lossless_widening(s, o):
            findings.append(Finding(name, widening_note(s, o), benign=True,
                                    evidence=f"{s.dtype} -> {o.dtype}, values compared bit for bit"))
        elif (s.dtype, s.shape) != (o.dtype, o.shape):
            side, evidence = header_change(s, o)
            findings.append(Finding(name, f"must be carried over unchanged but its header changed from {s.dtype} "
                                          f"{list(s.shape)} to {o.dtype} {list(o.shape)}.", side=side,
                                    evidence=evidence))
        else:
            pairs.append((s, o))
    return pairs, findings


def _digest_all(pairs: list[tuple[TensorInfo, TensorInfo]], workers: int,
                progress: Progress | None) -> list[PairDigest]:
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
    return Finding(d.name, f"must be byte-identical to the source but its payload differs "
                           f"from byte {d.first_difference} of {d.nbytes}.", side="quark",
                   evidence=f"expected MD5 {d.source_md5} (source); found {d.output_md5}; same dtype and shape, "
                            "and no planned algorithm may rewrite this tensor")
