"""`--base-model ORG/NAME` on run, resume, compare and sweep: each command takes it, records it with the
run's (or comparison's) options, and a later call without it keeps it. The card that states it is checked on
real runs (test_pipeline's gate-by-gate run: `run --base-model` then `resume`s, the card read back by
huggingface_hub). Here the commands stop at their first checkpoint on a model directory holding only its
config.json (intake reads nothing else), so nothing is quantized."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quark_ptq_eval.base.errors import CheckpointPending, UsageError
from quark_ptq_eval.base.gates import FlagApprover
from quark_ptq_eval.base.state import RunState
from quark_ptq_eval.cli.main import main

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
          "vocab_size": 256, "torch_dtype": "float32"}


@pytest.fixture
def model_dir(tmp_path) -> Path:
    directory = tmp_path / "tiny-local"  # as `hf download ORG/NAME --local-dir DIR` leaves it: no Hub id in sight
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return directory


def stored(root: Path) -> str | None:
    return RunState.load(root).options.get("base_model")


def test_run_records_it_and_resume_keeps_or_replaces_it(model_dir, tmp_path, capsys):
    wd, out = tmp_path / "work", tmp_path / "out"
    assert main(["run", str(model_dir), "-o", str(out), "--workdir", str(wd), "--base-model", "acme/tiny",
                 "--offline"]) == 3  # stopped at checkpoint 1
    assert stored(wd) == "acme/tiny"
    assert main(["resume", "--workdir", str(wd)]) == 3 and stored(wd) == "acme/tiny"  # kept without the flag
    assert main(["resume", "--workdir", str(wd), "--base-model", "acme/tiny-v2"]) == 3
    assert stored(wd) == "acme/tiny-v2"  # given again: the new one


def test_compare_records_it_for_the_chosen_schemes_card_and_keeps_it(model_dir, tmp_path):
    root = tmp_path / "cmp"
    assert main(["compare", str(model_dir), "--schemes", "int8,int4_wo_32", "-o", str(root),
                 "--base-model", "acme/tiny", "--offline"]) == 3
    assert stored(root) == "acme/tiny"
    assert main(["compare", "-o", str(root)]) == 3 and stored(root) == "acme/tiny"  # a re-run keeps it


def test_sweep_gives_each_model_its_own(model_dir, tmp_path):
    from quark_ptq_eval.flows.sweep import load_grid, sweep, with_base_models

    grid = tmp_path / "grid.yaml"
    grid.write_text(f"models: {{a: {model_dir}, b: {model_dir}}}\nschemes: [int8]\nbase_models: {{a: acme/tiny-a}}\n")
    with pytest.raises(CheckpointPending):  # both comparisons wait at their intake
        sweep(grid, tmp_path / "out", approver=FlagApprover([]), base_models=["b=acme/tiny-b"])
    assert (stored(tmp_path / "out" / "a"), stored(tmp_path / "out" / "b")) == ("acme/tiny-a", "acme/tiny-b")
    # one id with no label names nothing when the grid has two models; a label must be the grid's
    with pytest.raises(UsageError, match="names no model, and the grid has 2"):
        with_base_models(load_grid(grid), ["acme/tiny"])
    with pytest.raises(UsageError, match="c is none of the grid's models"):
        with_base_models(load_grid(grid), ["c=acme/tiny"])
    one = with_base_models(load_grid(grid), ["a=acme/other"])
    assert one.base_models == {"a": "acme/other"}  # the command line's wins over the grid's


@pytest.mark.parametrize("command", ["run", "compare", "sweep"])
def test_a_value_that_is_no_hub_id_is_refused_before_anything_is_written(command, model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"models: [{model_dir}]\nschemes: [int8]\n")
    argv = {"run": ["run", str(model_dir), "-o", str(out), "--workdir", str(tmp_path / "work")],
            "compare": ["compare", str(model_dir), "--schemes", "int8", "-o", str(out)],
            "sweep": ["sweep", str(grid), "-o", str(out)]}[command]
    assert main([*argv, "--base-model", "my local copy", "--offline"] if command != "sweep"
                else [*argv, "--base-model", "my local copy"]) == 2
    err = capsys.readouterr().err
    assert "--base-model 'my local copy' is not a Hugging Face Hub id (ORG/NAME)" in err and "Traceback" not in err
    assert not list(tmp_path.rglob("run_state.json")) and not list(tmp_path.rglob("model_analysis.json"))
