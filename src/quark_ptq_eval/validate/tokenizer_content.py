"""What a tokenizer *does*, read from its files with ``json`` and the ``tokenizers`` library (no model).

Newer transformers re-save tokenizers in another packaging (merges as pairs instead of
strings, special tokens moved from ``special_tokens_map.json`` into ``tokenizer_config.json``,
the chat template into ``chat_template.jinja``). Two tokenizer file sets are the same tokenizer
when vocabulary, merges, added tokens, normalizer, pre-tokenizer, post-processor (BOS/EOS
template), decoder, ``add_bos_token``/``add_eos_token``, special tokens and their ids, chat
template and ``model_max_length`` agree, and a fixed multilingual probe encodes to the same ids.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

TOKENIZER_FILES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
    "chat_template.jinja", "chat_template.json",
})
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
                "additional_special_tokens", "extra_special_tokens")
BEHAVIOUR_KEYS = ("add_bos_token", "add_eos_token", "model_max_length")
MAX_TOKENIZER_BYTES = 512 * 1024 * 1024
# Latin, accents, CJK, Cyrillic, Arabic, Devanagari, emoji, digits, code, odd whitespace.
PROBE = ("The quick brown fox jumps over 13 lazy dogs. Größe, café, naïve; 东京は雨です。 "
         "Привет, мир! مرحبا بالعالم नमस्ते 🙂👍 def f(x):\n\treturn x ** 2  # done\r\n  trailing  ")


def is_tokenizer_file(relative: str) -> bool:
    return "/" not in relative and relative in TOKENIZER_FILES


def tokenizer_content(model_dir: Path) -> dict[str, Any]:
    """The comparable content of the tokenizer files found in ``model_dir``."""
    content: dict[str, Any] = {}
    _from_tokenizer_json(model_dir / "tokenizer.json", content)
    _from_slow_files(model_dir, content)
    special: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        data = _load_json(model_dir / name)
        for key in SPECIAL_KEYS:
            if data.get(key) is not None:
                special[key] = _token_text(data[key])
        if "chat_template" in data:
            content["chat_template"] = data["chat_template"]
        for tid, tok in (data.get("added_tokens_decoder") or {}).items():
            content.setdefault("added_tokens", {})[str(tid)] = [_token_text(tok), bool(tok.get("special"))]
        for key in BEHAVIOUR_KEYS:
            if key in data:
                content[key] = data[key]
    content["special_tokens"] = special
    content["special_token_ids"] = _special_ids(special, content)
    content["probe_encoding"] = _probe_ids(model_dir / "tokenizer.json")
    _chat_template_files(model_dir, content)
    for binary in ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model"):
        if (model_dir / binary).is_file():
            content[binary] = hashlib.sha256((model_dir / binary).read_bytes()).hexdigest()
    return content


def differing_aspects(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    aspects = []
    for key in sorted(set(a) | set(b)):
        if key in ("special_tokens", "special_token_ids"):
            sa, sb = a.get(key, {}), b.get(key, {})
            what = "special token" if key == "special_tokens" else "special token id"
            aspects += [f"{what} {k}" for k in sorted(set(sa) | set(sb)) if sa.get(k) != sb.get(k)]
        elif a.get(key) != b.get(key):
            aspects.append(key.replace("_", " "))
    return aspects


def describe(content: dict[str, Any]) -> str:
    vocab = content.get("vocab")
    size = len(vocab) if isinstance(vocab, (dict, list)) else 0
    return (f"{size} vocabulary entries, {len(content.get('merges') or [])} merges, "
            f"{len(content.get('added_tokens') or {})} added tokens, special tokens "
            f"{sorted(content.get('special_tokens', {}).items())}")


def _from_tokenizer_json(path: Path, content: dict[str, Any]) -> None:
    data = _load_json(path)
    if not data:
        return
    model = data.get("model") or {}
    content["model_type"] = model.get("type")
    content["vocab"] = model.get("vocab")
    content["merges"] = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    for tok in data.get("added_tokens") or []:
        content.setdefault("added_tokens", {})[str(tok.get("id"))] = [tok.get("content"), bool(tok.get("special"))]
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        content[part] = data.get(part)


def _from_slow_files(model_dir: Path, content: dict[str, Any]) -> None:
    vocab = _load_json(model_dir / "vocab.json")
    if vocab and "vocab" not in content:
        content["vocab"] = vocab
    merges = model_dir / "merges.txt"
    if merges.is_file() and "merges" not in content:
        lines = merges.read_text(encoding="utf-8").splitlines()
        content["merges"] = [ln for ln in lines if ln and not ln.startswith("#version")]
    for tok, tid in (_load_json(model_dir / "added_tokens.json") or {}).items():
        content.setdefault("added_tokens", {}).setdefault(str(tid), [tok, True])


def _chat_template_files(model_dir: Path, content: dict[str, Any]) -> None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        content["chat_template"] = jinja.read_text(encoding="utf-8")
    as_json = _load_json(model_dir / "chat_template.json")
    if as_json.get("chat_template") is not None:
        content["chat_template"] = as_json["chat_template"]


def _special_ids(special: dict[str, Any], content: dict[str, Any]) -> dict[str, Any]:
    """Each special token's id, from the vocabulary or the added tokens."""
    vocab: dict[str, Any] = content["vocab"] if isinstance(content.get("vocab"), dict) else {}
    added = {v[0]: int(k) for k, v in (content.get("added_tokens") or {}).items() if str(k).lstrip("-").isdigit()}
    ids: dict[str, Any] = {}
    for key, text in special.items():
        texts = text if isinstance(text, list) else [text]
        found = [added.get(t, vocab.get(t)) if isinstance(t, str) else None for t in texts]
        ids[key] = found if isinstance(text, list) else found[0]
    return ids


def _probe_ids(path: Path) -> list[int] | None:
    """The fast tokenizer's ids for :data:`PROBE` (with its special-token template), or None."""
    if not path.is_file() or path.stat().st_size > MAX_TOKENIZER_BYTES:
        return None
    try:
        from tokenizers import Tokenizer  # the Rust library only: no transformers, no model
    except ImportError:
        return None
    try:
        return Tokenizer.from_file(str(path)).encode(PROBE, add_special_tokens=True).ids
    except Exception:  # noqa: BLE001 - a file the library refuses encodes nothing, so it differs
        return [-1]


def _token_text(value: Any) -> Any:
    if isinstance(value, dict):
        return value.get("content")
    if isinstance(value, list):
        return [_token_text(v) for v in value]
    return value


def _load_json(path: Path) -> dict[str, Any]:
    if not path.is_file() or path.stat().st_size > MAX_TOKENIZER_BYTES:
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return {}  # an unreadable file contributes nothing, so its content shows up as different
    return data if isinstance(data, dict) else {}
