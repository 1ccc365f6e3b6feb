"""The speed tier: the export (and with ``--baseline`` its source) served by the vLLM the user names
(``--vllm-python``), sized as Tier 3 sizes its servers, and measured with vLLM's own serving benchmark
(``vllm.benchmarks.serve``, a random dataset drawn with the model's tokenizer): a warm-up, then
``--speed-repeats`` repeats whose medians, spread and throughput gain (with a 95 % interval) the report shows.

One job per module: ``workload`` (the options and the host-fitted workload, each value with its reason),
``driver`` (run by vLLM's own interpreter: the benchmark's warm-up and repeats in one process), ``stats``
(medians, the gain and its interval, the server's KV-cache capacity read from its log), ``tier`` (the
tier's contract: prepare -> estimate, score -> outcome, the report section).
"""
