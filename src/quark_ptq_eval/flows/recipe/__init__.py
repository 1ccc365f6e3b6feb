"""The recipe's run: its steps in order (pipeline.py: intake -> plan -> manifest -> execute -> validate -> eval ->
card, each gated), the steps themselves (quantize_steps, check_steps, card_step, plan_scan, budget_side), what a
run was asked (run_options) and what it tells (status, summary). The commands that run it are in cli/; the
Python API over it, compare and sweep is flows/api.py."""
