"""The budget search (`--budget-bits`, `--budget-size`, `--max-kl` with `--formats`): the best per-group mix of
formats within a budget, from one sensitivity scan per format.

Between the sensitivity scan and the flows: it reads the scans (sensitivity/), the plan's request, vLLM's fused
groups and the target's rules (plan/) and the safetensors headers (base/); the flows call it.

- ``ask.py``: the budget the request asks for (bits, size or accuracy floor) and the default formats;
- ``request.py``: the formats to mix, and what the search refuses before anything is measured;
- ``cost.py``: the cost model (a size budget as effective bits, the narrowest mix's bits);
- ``knapsack.py``: each linear's bytes per format and the exact multiple-choice knapsack (HiGHS);
- ``groups.py``: the search groups (fused groups and scan units), the mix as a plan's overrides, the side plans;
- ``search.py``: ``with_budget_search``, the plan remade with the searched mix;
- ``report.py``: search_report.{json,md,png}; ``measured.py``: its measured part, after the side by side.
"""
