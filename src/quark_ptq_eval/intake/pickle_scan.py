"""Scan pickled weights (``pytorch_model.bin``, ``*.pt``) for code, without running any of it.

A pickle runs code by naming a callable (``GLOBAL``/``STACK_GLOBAL``/``INST``) and calling it
(``REDUCE``). :func:`scan_pickle` walks the opcodes with :mod:`pickletools` (which only parses)
and refuses any global outside the allowlist torch's ``weights_only`` loader rebuilds tensors
with, naming it (``posix.system``). It reads the ``data.pkl`` of a torch zip checkpoint, or the
leading pickles of torch's legacy format, never the tensor bytes; torch is not imported.
"""

from __future__ import annotations

import _compat_pickle
import contextlib
import os
import pickletools
import stat
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from quark_ptq_eval.base.errors import UnsafeInputError

_LEGACY_TYPES = ("Byte", "Char", "Short", "Int", "Long", "Half", "Float", "Double", "BFloat16", "Bool")
_SPARSE_TYPES = tuple(t for t in _LEGACY_TYPES if t != "Bool")
_WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)
_DTYPES = ("bfloat16", "bool", "complex32", "complex64", "complex128", "bcomplex32", "float16", "float32", "float64",
           "float4_e2m1fn_x2", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
           "qint8", "qint32", "quint8", "quint2x4", "quint4x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
           *(f"int{n}" for n in _WIDTHS), *(f"uint{n}" for n in _WIDTHS), "per_tensor_affine", "per_tensor_symmetric",
           "per_channel_affine", "per_channel_symmetric", "per_channel_affine_float_qparams")
_REBUILDS = ("tensor", "tensor_v2", "tensor_v3", "parameter", "parameter_with_state", "qtensor", "sparse_tensor",
             "nested_tensor", "meta_tensor_no_storage", "device_tensor_from_cpu_tensor", "device_tensor_from_numpy",
             "wrapper_subclass")

# torch 2.14's weights_only allowlist (torch._weights_only_unpickler._get_allowed_globals), spelled
# out so intake need not import torch; tests/test_untrusted_checkpoints.py compares the two.
ALLOWED_GLOBALS: frozenset[str] = frozenset({
    "collections.OrderedDict", "collections.Counter", "torch.nn.parameter.Parameter",
    "torch.serialization._get_layout", "torch.Size", "torch.Tensor", "torch.device", "_codecs.encode",
    "builtins.bytearray", "builtins.set", "builtins.complex", "torch._tensor._rebuild_from_type_v2",
    "torch.storage.TypedStorage", "torch.storage.UntypedStorage",
    *(f"torch.{d}" for d in _DTYPES),
    *(f"torch._utils._rebuild_{r}" for r in _REBUILDS),
    *(f"torch.{t}Tensor" for t in _LEGACY_TYPES), *(f"torch.cuda.{t}Tensor" for t in _LEGACY_TYPES),
    *(f"torch.sparse.{t}Tensor" for t in _SPARSE_TYPES), *(f"torch.cuda.sparse.{t}Tensor" for t in _SPARSE_TYPES),
    *(f"torch{p}.{t}Storage" for p in ("", ".cuda") for t in (*_LEGACY_TYPES, "ComplexDouble", "ComplexFloat")),
    *(f"torch.{t}Storage" for t in ("QInt32", "QInt8", "QUInt2x4", "QUInt4x2", "QUInt8")),
})
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # the first pickle of torch's pre-zip format
_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING",
                         "BINSTRING", "STRING"})
_NEUTRAL_OPS = frozenset({"PROTO", "FRAME", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"})  # leave the stack as is


def scan_pickle(path: str | os.PathLike[str]) -> None:
    """Return when ``path`` only rebuilds tensors; else raise one UnsafeInputError sentence."""
    path = Path(path)
    try:
        with _open_regular(path) as fh:
            head = fh.read(4)
            fh.seek(0)
            if head.startswith(b"PK\x03\x04"):
                _scan_zip(path, fh)
            elif head[:1] == b"\x80":
                _scan_legacy(path, fh)
            else:
                raise UnsafeInputError(f"{path} is neither a torch checkpoint nor a pickle; refusing to load it.")
    except OSError as exc:
        raise UnsafeInputError(f"{path} cannot be read: {exc.strerror or exc}.") from None


@contextlib.contextmanager
def _open_regular(path: Path) -> Iterator[IO[bytes]]:
    # O_NONBLOCK + fstat: a FIFO planted as a weight file must not make intake hang.
    with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK)) as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise UnsafeInputError(f"{path} is not a regular file; refusing to read it as weights.")
        yield fh


def _scan_zip(path: Path, fh: IO[bytes]) -> None:
    try:
        with zipfile.ZipFile(fh) as archive:
            pickles = [n for n in archive.namelist() if n.endswith(".pkl")]
            if not any(n.rsplit("/", 1)[-1] == "data.pkl" for n in pickles):
                raise UnsafeInputError(f"{path} is a zip archive without the data.pkl of a torch checkpoint; "
                                       "refusing to load it.")
            for name in pickles:
                with archive.open(name) as member:
                    _scan_one(f"{path} ({name})", member)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, EOFError):
        raise UnsafeInputError(f"{path} is a corrupt zip archive; refusing to load it.") from None


def _scan_legacy(path: Path, fh: IO[bytes]) -> None:
    """Torch's legacy format is five pickles (magic, protocol, sys info, the data, storage keys),
    then raw storage bytes; a plain pickle is one."""
    if _scan_one(str(path), fh) != _LEGACY_MAGIC:
        return
    for _ in range(4):
        _scan_one(str(path), fh)


def _scan_one(label: str, stream: IO[bytes]) -> object:
    """Scan one pickle up to its STOP; the value of a pickle that is just one integer, else None."""
    memo: dict[int, str | None] = {}
    top: list[str | None] = []  # what the last value-pushing opcodes left: strings, or None if unknown
    value, count = None, 0
    try:
        for op, arg, _pos in pickletools.genops(stream):
            count += 1
            name = op.name
            if name in ("GLOBAL", "INST"):
                _check_global(label, *str(arg).split(" ", 1))
            elif name == "STACK_GLOBAL":
                if len(top) < 2 or top[-1] is None or top[-2] is None:
                    raise UnsafeInputError(f"{label} names a global the scan cannot read; refusing to load it.")
                _check_global(label, top[-2], top[-1])
            elif name in ("EXT1", "EXT2", "EXT4"):
                raise UnsafeInputError(f"{label} uses the copyreg extension registry; refusing to load it.")
            elif name in ("LONG1", "LONG4", "INT", "LONG", "BININT", "BININT1", "BININT2"):
                value = arg
            _track(name, arg, top, memo)
    except ValueError as exc:  # pickletools' word for malformed input
        raise UnsafeInputError(f"{label} is not a valid pickle ({exc}); refusing to load it.") from None
    return value if count <= 4 else None


def _track(name: str, arg: object, top: list[str | None], memo: dict[int, str | None]) -> None:
    """Follow the strings STACK_GLOBAL would pop; anything else forgets what the stack holds."""
    if name in _STRING_OPS:
        top.append(arg if isinstance(arg, str) else arg.decode("latin-1") if isinstance(arg, bytes) else None)
    elif name in ("GET", "BINGET", "LONG_BINGET"):
        top.append(memo.get(arg) if isinstance(arg, int) else None)  # arg: the memo index
    elif name == "MEMOIZE":
        memo[len(memo)] = top[-1] if top else None
    elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
        if isinstance(arg, int):  # the memo index
            memo[arg] = top[-1] if top else None
    elif name not in _NEUTRAL_OPS:
        top.clear()


def _check_global(label: str, module: str, name: str = "") -> None:
    if (module, name) in _compat_pickle.NAME_MAPPING:  # Python 2 spellings, as pickle itself maps them
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    full = f"{module}.{name}"
    if full not in ALLOWED_GLOBALS:
        raise UnsafeInputError(
            f"{label} is a pickle that calls {full}, which is not one of the functions torch rebuilds "
            f"tensors with; refusing it before anything loads it.",
            "Use a safetensors copy of the model from a source you trust.")
