"""What validation and evaluation both run on: loading an export with the loader its config.json
calls for (``loading.py``), and starting a vLLM server on this host (``vllm_host.py``) sized for
the model and the host (``vllm_sizing.py``), for its whole life: health, hand-over, stop (``vllm_server.py``).

A layer of its own, after execute and before validate in tests/test_architecture.py's LAYERS (a server
is sized with the plan's memory model): validate/ and evaluate/ use it as a service, neither reaches
into the other for it. Importing it pulls in neither torch nor vLLM.
"""
