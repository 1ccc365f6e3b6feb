import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_tiny_model_is_trained_and_quantizable(tiny_llama, corpus, quantized):
    config = json.loads((tiny_llama / "config.json").read_text())
    assert config["model_type"] == "llama"
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    n_params = sum(p.numel() for p in model.parameters())
    assert 100_000 < n_params < 1_000_000
    ids = tok(corpus.read_text()[:4000], return_tensors="pt").input_ids[:, :256]
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    # Trained: far below the uniform-guess loss ln(vocab).
    assert loss < 0.75 * torch.log(torch.tensor(float(config["vocab_size"]))).item()

    out = quantized("int8")
    qmodel = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        assert torch.isfinite(qmodel(ids).logits).all()
