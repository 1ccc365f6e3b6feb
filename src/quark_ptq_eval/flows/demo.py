"""The embedded default: a tiny real causal LM and a local English corpus, built offline.

Used by ``make demo`` and by the test suite. The corpus is CPython's own docstrings (real
English every machine has); the tokenizer is a byte-level BPE trained on it on the spot; the
model (Llama or Qwen3 architecture, a few hundred thousand parameters) is trained for a few
seconds so that perplexity means something and quantization damage is visible.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import random
from dataclasses import dataclass
from pathlib import Path

STDLIB_PACKAGES = (
    "json", "email", "http", "logging", "unittest", "xml", "urllib", "concurrent", "importlib",
    "collections", "asyncio", "multiprocessing", "sqlite3", "html", "wsgiref", "ctypes",
)


def build_corpus(path: str | Path, max_chars: int = 600_000) -> Path:
    """Write docstrings of the standard library (one paragraph per line) to ``path``."""
    seen: set[str] = set()
    paragraphs: list[str] = []
    for mod in _stdlib_modules():
        for obj in [mod, *vars(mod).values()]:
            doc = getattr(obj, "__doc__", None)
            if not isinstance(doc, str) or doc in seen:
                continue
            seen.add(doc)
            for para in doc.split("\n\n"):
                text = " ".join(para.split())
                if len(text) > 80 and text.count(">>>") == 0:
                    paragraphs.append(text)
    random.Random(0).shuffle(paragraphs)
    out, total = [], 0
    for p in paragraphs:
        if total > max_chars:
            break
        out.append(p)
        total += len(p) + 1
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return path


def _stdlib_modules():
    for name in STDLIB_PACKAGES:
        try:
            pkg = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a missing optional stdlib module is fine
            continue
        yield pkg
        for info in pkgutil.iter_modules(getattr(pkg, "__path__", []), prefix=f"{name}."):
            if "test" in info.name or "__main__" in info.name:
                continue
            try:
                yield importlib.import_module(info.name)
            except Exception:  # noqa: BLE001
                continue


ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v biases
}


@dataclass(frozen=True)
class TinyShape:
    """The tiny model's size: tokenizer vocabulary, hidden width, decoder layers."""

    vocab_size: int = 512
    hidden: int = 128
    layers: int = 2


def build_tiny_model(
    out_dir: str | Path,
    corpus: str | Path,
    arch: str = "llama",
    shape: TinyShape | None = None,
    train_steps: int = 150,
    seed: int = 0,
) -> Path:
    """Train a tokenizer and a tiny causal LM on ``corpus`` and save both to ``out_dir``."""
    import torch
    import transformers
    from tokenizers import ByteLevelBPETokenizer

    shape = shape or TinyShape()
    vocab_size, hidden, layers = shape.vocab_size, shape.hidden, shape.layers
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = Path(corpus).read_text(encoding="utf-8")

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(text.splitlines(), vocab_size=vocab_size, min_frequency=2,
                            special_tokens=["<|endoftext|>", "<|pad|>"], show_progress=False)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
        unk_token="<|endoftext|>", pad_token="<|pad|>",
    )
    tokenizer.model_max_length = 2048

    config_name, model_name, extra = ARCHITECTURES[arch]
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    train(model, tokenizer(text, return_tensors="pt").input_ids[0], train_steps, seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    (out_dir / "README.md").write_text(f"# tiny-{arch}\n\nA tiny {arch} test model trained on CPython docstrings.\n")
    return out_dir


def train(model, ids, steps: int, seed: int, seq: int = 128, batch: int = 16) -> None:
    """``steps`` of next-token training on random windows of ``ids`` (parameters that need no grad stay as they are)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=gen)
        x = torch.stack([ids[s : s + seq] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    model.eval()


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Build the embedded tiny model and corpus.")
    p.add_argument("out_dir")
    p.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama")
    args = p.parse_args(argv)
    root = Path(args.out_dir)
    corpus = build_corpus(root / "corpus.txt")
    model = build_tiny_model(root / f"tiny-{args.arch}", corpus, arch=args.arch)
    print(json.dumps({"corpus": str(corpus), "model": str(model)}))


if __name__ == "__main__":
    main()
