"""quark-ptq-eval: quantize -> validate -> evaluate Hugging Face causal LLMs with AMD Quark."""

__version__ = "0.1.0"
