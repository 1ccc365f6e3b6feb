"""The newcomer's path (issue 14): quark-cli habits, preflight, first-use costs, Tier 1 offline prompt,
lm-eval's own chatter kept in the log."""

from __future__ import annotations

import builtins
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from quark_ptq_eval.base import first_use
from quark_ptq_eval.cli.main import build_parser, main
from quark_ptq_eval.cli.quark_cli_flags import (
    NOT_TRANSLATED,
    QUARK_CLI_FLAGS,
    SAME_SPELLING,
    rewrite_model_dir,
    translate,
)
from quark_ptq_eval.evaluate.ppl import text as tier1_text

ROOT = Path(__file__).resolve().parents[2]
TASKS_DIR = Path(__file__).parents[1] / "data" / "eval_tasks"


def no_hf_cache(monkeypatch, tmp_path) -> None:
    """A machine where nothing was ever downloaded (so wikitext-2 is not cached), offline."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    for var in ("HF_DATASETS_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


# ---------------------------------------------------------------- quark-cli spellings


def test_quark_cli_spellings_are_hidden_aliases_of_ours():
    argv = ["run", "--model_dir", "m", "--output_dir", "o", "--quant_scheme", "fp8", "--num_calib_data", "64",
            "--seq_len", "256", "--quant_algo", "awq,gptq", "--kv_cache_dtype", "fp8", "--layer_quant_scheme",
            "*o_proj", "int8", "--batch_size", "2", "--multi_device", "--dataset", "wikitext", "--skip_evaluation",
            "--exclude_layers", "lm_head", "*down_proj", "--no_trust_remote_code"]
    args = build_parser().parse_args(rewrite_model_dir(argv))
    assert (args.model, args.output_dir, args.scheme, args.algorithm) == ("m", "o", "fp8", "awq,gptq")
    assert (args.num_calib_samples, args.calib_seq_len, args.batch_size) == (64, 256, 2)
    assert args.seq_len is None  # quark-cli's --seq_len is the calibration length, not Tier 1's window
    assert (args.kv_cache_scheme, args.calib_dataset, args.eval_tier) == ("fp8", "wikitext", "skip")
    assert args.layer_quant_config == [["*o_proj", "int8"]] and args.multi_device is True
    assert args.exclude_layers == ["lm_head", "*down_proj"] and args.trust_remote_code is False
    bare = build_parser().parse_args(rewrite_model_dir(["plan", "--model_dir=m", "--exclude_layers"]))
    assert bare.model == "m" and bare.no_exclusions is True and bare.exclude_layers is None


def test_aliases_stay_out_of_help_and_docs(capsys):
    docs = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    for command in ("run", "plan", "resume"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        help_text = capsys.readouterr().out
        for flag in QUARK_CLI_FLAGS:
            for spelling in flag.quark:
                assert spelling not in help_text and f"`{spelling}`" not in docs


@pytest.mark.slow
def test_every_quark_cli_flag_is_translated_or_named():
    """Against the installed quark-cli's own --help: nothing it accepts falls through unexplained."""
    from quark_ptq_eval.context import quark_cli

    flags = quark_cli.quark_cli_flags()  # the session's cache (conftest), shared with the manifest tests
    ours = {s for f in QUARK_CLI_FLAGS for s in f.quark} | set(SAME_SPELLING) | set(NOT_TRANSLATED) | {"--model_dir"}
    assert ours <= flags, f"not in the installed quark-cli: {sorted(ours - flags)}"
    assert flags - ours <= {"-h", "--help"}, f"quark-cli flags without a translation: {sorted(flags - ours - {'-h', '--help'})}"


def test_translate_a_pasted_line():
    line = ("$ CUDA_VISIBLE_DEVICES=0 quark-cli torch-llm-ptq --model_dir /m \\\n --quant_scheme int4_wo_128 "
            "--quant_algo awq --exclude_layers --output_dir /o")
    args, rows = translate(line)
    assert args == ["/m", "--output-dir", "/o", "--scheme", "int4_wo_128", "--algorithm", "awq", "--no-exclusions",
                    "--num-calib-samples", "512", "--calib-seq-len", "512"]
    notes = {quark: note for quark, _, note in rows}
    assert "quark-cli's default" in notes["--num_calib_data"]  # the pasted command calibrated on 512 x 512
    assert "trusts the model's code" in notes["(no --no_trust_remote_code)"]


@pytest.mark.parametrize(("line", "says"), [
    ("quark-cli torch-llm-ptq --model_dir m --quant_schem fp8", "does not know '--quant_schem'"),
    ("quark-cli torch-llm-ptq --model_dir m --template_file t.json", "cannot translate --template_file"),
    ("quark-cli torch-llm-ptq --quant_scheme fp8", "has no --model_dir"),
    ("python quantize_quark.py --model_dir m", "not `python ...`"),
    ("quark-cli torch-llm-ptq --model_dir m --num_calib_data many", "does not parse"),
])
def test_import_command_refuses_in_one_sentence(line, says, capsys, tmp_path):
    assert main(["import-command", line, "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and err.count("\n") <= 2
    assert not (tmp_path / "w").exists()  # refused before anything was created


@pytest.mark.slow
def test_import_command_shows_the_plan_for_approval(cli, tiny_llama, corpus, tmp_path):
    line = (f"quark-cli torch-llm-ptq --model_dir {tiny_llama} --output_dir {tmp_path / 'out'} --quant_scheme int8 "
            "--quant_algo smoothquant --exclude_layers lm_head '*down_proj' --layer_quant_scheme '*o_proj' "
            "int4_wo_128 --num_calib_data 16 --seq_len 64 --kv_cache_dtype fp8")
    stopped = cli("import-command", line, "--calib-data", corpus, "--offline", "--workdir", tmp_path / "w")
    assert stopped.rc == 3 and "checkpoint 1 (intake)" in stopped.err  # the normal gates, not a shortcut
    assert "Equivalent: quark-ptq-eval run" in stopped.err and "--execution-mode plan_only" in stopped.err
    done = cli("resume", "--workdir", tmp_path / "w", "--approve", "intake,plan")
    assert done.rc == 0, done.err
    plan = json.loads((tmp_path / "w" / "quant_plan.json").read_text())
    assert (plan["global_scheme"], plan["algorithm"], plan["kv_cache_scheme"]) == ("int8", "smoothquant", "fp8")
    assert plan["exclude_layers"] == ["lm_head", "*down_proj"]
    assert plan["layer_quant_config"] == {"*o_proj": "int4_wo_128"}
    assert (plan["calibration"]["num_samples"], plan["calibration"]["seq_len"]) == (16, 64)
    assert (tmp_path / "w" / "run_manifest.yaml").is_file()
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()  # plan only: nothing ran


# ---------------------------------------------------------------- preflight


def test_preflight_is_one_screen_with_fixes_and_no_quark_import(tmp_path, monkeypatch):
    no_hf_cache(monkeypatch, tmp_path)
    code = ("import sys, json; from quark_ptq_eval.cli.main import main; rc = main(sys.argv[1:]); "
            "print(json.dumps({'rc': rc, 'quark.torch': 'quark.torch' in sys.modules, 'torch': 'torch' in sys.modules}))")
    proc = subprocess.run([sys.executable, "-c", code, "preflight", "--workdir", str(tmp_path / "w")],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))
    *screen, last = proc.stdout.strip().splitlines()
    facts = json.loads(last)
    assert facts["rc"] == 0 and not facts["quark.torch"], proc.stderr
    if not (Path("/dev/kfd").exists() or Path("/proc/driver/nvidia").exists()):
        assert not facts["torch"]  # without a GPU driver, torch is not even imported
    text = "\n".join(screen)
    for topic in ("accelerator", "torch", "amd-quark", "quark-cli", "first use", "Tier 2", "Tier 3", "disk", "offline"):
        assert f" {topic} " in text
    assert len(screen) <= 24  # one screen
    assert "wikitext-2 not cached" in text and "hint: offline, give local text: --calib-data FILE and --eval-data FILE" in text
    assert (tmp_path / "w" / "env_context.json").is_file()


def test_preflight_json_lists_the_checks(cli, tmp_path):
    result = cli("preflight", "--workdir", tmp_path, "--json")
    checks = {c["topic"]: c for c in json.loads(result.out)["checks"]}
    assert result.rc == 0 and {"torch", "amd-quark", "disk", "offline"} <= set(checks)
    assert all(c["fix"] for c in checks.values() if c["ok"] is False)  # every missing piece says how to fix it


# ---------------------------------------------------------------- first-use costs


@pytest.mark.slow
def test_hw_emulation_build_dir_is_where_torch_builds_it(quantized):
    """Quark was imported here (the quantized export), so its kernels are built: found where torch puts them."""
    from torch.utils.cpp_extension import _get_build_directory

    quantized("int8")
    state, where = first_use.hw_emulation_state()
    if where is not None and where.name != "hw_emulation":  # not a wheel with precompiled kernels
        assert state == "built"
        assert where == Path(_get_build_directory(first_use.HW_EMULATION_LIB, False))


def test_first_use_costs_are_announced_once(tmp_path):
    code = ("from quark_ptq_eval.base.first_use import announce_quark_import as a, hw_emulation_state as s; "
            "print(s()[0]); a('loading x'); a('loading y')")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "fresh-extensions")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.stdout.strip() == "missing"
    assert proc.stderr.count("compiles its hardware-emulation kernels") == 1
    assert proc.stderr.count("importing Quark for loading x") == 1 and "loading y" not in proc.stderr


def test_catalog_build_is_announced(tmp_path):
    env = {**os.environ, "QUARK_PTQ_EVAL_CACHE": str(tmp_path / "fresh-cache")}
    code = ("from quark_ptq_eval.base.catalog import catalog_built as c; "
            "from quark_ptq_eval.base.first_use import announce_catalog_build as a; print(c()); a()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.stdout.strip() == "False" and "asking it which schemes" in proc.stderr


# ---------------------------------------------------------------- Tier 1 offline without --eval-data


def test_tier1_offline_without_text_is_refused_before_any_gate(cli, tiny_llama, corpus, tmp_path, monkeypatch):
    no_hf_cache(monkeypatch, tmp_path)
    # No text at all (with --calib-data, Tier 1 scores its held-out part: tests/test_data_trust.py)
    result = cli("run", tiny_llama, "-o", tmp_path / "out", "--workdir", tmp_path / "w", "--scheme", "int8",
                 "--offline", "--yes", "--eval-tier", "ppl")
    assert result.rc == 2 and "--eval-data FILE" in result.err
    assert not (tmp_path / "w" / "model_analysis.json").exists()  # nothing asked, nothing done


def test_ask_tier1_text_offers_an_existing_default(corpus, tmp_path, capsys):
    class Person:  # answers the prompt the way someone at the terminal would
        def __init__(self, answers):
            self.answers, self.asked = list(answers), []

        def ask_text(self, question, default=None):
            self.asked.append((question, default))
            answer = self.answers.pop(0)
            return answer or default

    person = Person(["/no/such/file.txt", ""])
    assert tier1_text.ask_tier1_text(person, str(corpus)) == str(corpus.resolve())
    assert person.asked[0][1] == str(corpus) and "does not exist" in capsys.readouterr().err
    assert tier1_text.ask_tier1_text(Person([""]), str(tmp_path / "missing.txt")) is None  # no default that exists


@pytest.mark.slow
def test_tier1_checkpoint_asks_for_text_instead_of_failing(tiny_llama, corpus, tmp_path, monkeypatch):
    corpus_file = corpus
    import quark_ptq_eval as qpe

    no_hf_cache(monkeypatch, tmp_path)
    answers = iter(["ppl", "", "n"])  # tier, text (Enter: the default), baseline
    prompts: list[str] = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": prompts.append(prompt) or next(answers))
    # One document: nothing can be held out of it for Tier 1, so the checkpoint asks for text.
    corpus = tmp_path / "one-document.txt"
    corpus.write_text(" ".join(Path(corpus_file).read_text(encoding="utf-8").splitlines()[:100]), encoding="utf-8")
    summary = qpe.run(tiny_llama, tmp_path / "out", workdir=tmp_path / "w", offline=True,
                      approver=qpe.TerminalApprover(all_gates=True), scheme="int8", calib_data=str(corpus),
                      num_calib_samples=8, calib_seq_len=64, eval_options={"seq_len": 64, "max_windows": 4})
    assert summary["evaluation"]["tier"] == "ppl", summary
    assert prompts[1] == f"[{corpus}] > "  # the default offered exists
    results = json.loads((tmp_path / "w" / "eval_results.json").read_text())
    assert str(corpus) in json.dumps(results)


# ---------------------------------------------------------------- Tier 2: lm-eval's and git's own words


@pytest.mark.slow
def test_tier2_keeps_lm_eval_and_git_messages_in_the_log(cli, quantized, tmp_path):
    outside_git = tmp_path / "not-a-repo"
    outside_git.mkdir()
    result = cli("eval", "--quantized", quantized("int8"), "--tier", "lm_eval", "--tasks", "qpe_docstring_mc",
                 "--include-path", TASKS_DIR, "--limit", "4", "--device", "cpu", "--workdir", "w", cwd=outside_git)
    assert result.rc == 0, result.err
    assert "not of type `str`" not in result.err and "fatal: not a git repository" not in result.err
    log = (outside_git / "w" / "logs" / "lm_eval.log").read_text(encoding="utf-8")
    assert "not of type `str`" in log and "not a git repository" in log


def test_readme_install_is_the_path_test_install_walks():
    import tomllib

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    install = readme[readme.index("## Install"):readme.index("## The recipe")]
    version = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    assert "pip install quark-ptq-eval" not in install  # not on an index
    assert "pip install ." in install and "pip wheel --no-deps -w dist ." in install
    assert f"pip install dist/quark_ptq_eval-{version}-py3-none-any.whl" in install
    assert "tests/test_install.py" in install


def _section(readme: str, start: str, end: str) -> str:
    return readme[readme.index(start):readme.index(end)]


def _shell_lines(text: str) -> list[str]:
    """The commands of every ```bash block, continuation lines joined, comments dropped."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                lines.append(shlex.join(words))
    return lines


def test_readme_install_commands_name_real_targets_files_and_scripts():
    """Every command README's Install and first-run sections give: a real Makefile target, console
    script and subcommand (parsed by our own parser), pip target, extra or pinned pair. Nothing is installed."""
    import tomllib

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    install = readme[:readme.index("## A real session")] + _section(readme, "## Install", "## The recipe")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M))
    pins = dict(line.split("==") for line in (ROOT / "requirements-dev.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    commands = _shell_lines(install) + [f"make {t}" for t in re.findall(r"`make (\w+)`", install)]
    commands += [c for c in re.findall(r"`(quark-ptq-eval [^`]*)`", install) if "..." not in c]
    checked = set()
    for command in commands:
        argv = shlex.split(command.split(" && ")[-1])
        if argv[0] == "make":
            assert argv[1] in targets, f"README: `{command}` but the Makefile has no {argv[1]} target"
        elif argv[0] in project["scripts"]:
            try:  # our own parser: a misspelt subcommand or flag exits 2
                build_parser().parse_args(rewrite_model_dir(argv[1:]) if argv[1] != "import-command" else argv[1:])
            except SystemExit as stop:
                assert stop.code == 0, f"README: `{command}` does not parse"
        elif argv[:2] == ["pip", "install"] and argv[2].startswith("torch=="):
            assert "torchvision==" in command  # the pair; ours is pinned for make
            torch, vision = (int(pins[n].split(".")[1]) for n in ("torch", "torchvision"))
            assert vision == torch + 15 and f"e.g. 2.{torch} with 0.{vision}" in install
        elif argv[:2] == ["pip", "install"] and argv[2].startswith("."):
            extra = re.fullmatch(r"\.(?:\[(\w+)\])?", argv[2]).group(1)
            assert extra is None or extra in project["optional-dependencies"], command
        elif argv[:2] in (["pip", "install"], ["pip", "wheel"]):
            assert argv[-1] in (".", f"dist/quark_ptq_eval-{project['version']}-py3-none-any.whl"), command
        elif argv[:2] not in (["git", "clone"], ["python3", "-m"]):
            raise AssertionError(f"README's install path has a command this test does not know: {command}")
        checked.add(argv[0] if argv[0] != "pip" else " ".join(argv[:2]))
    assert {"make", "quark-ptq-eval", "pip install", "pip wheel", "git"} <= checked
    pulled = re.search(r"pip install \.\s+# pulls (.*), \.\.\.", install).group(1).split(", ")
    assert all(any(dep.startswith(p) for dep in project["dependencies"]) for p in pulled), pulled
    assert all(any(e.replace("-", "_").startswith(p.replace("-", "_")) for e in project["optional-dependencies"]["eval"])
               for p in ("lm-eval", "matplotlib"))


def test_readme_first_run_preflight_is_what_a_fresh_machine_prints(tmp_path):
    """The preflight screen in README, line for line, against a run on a fresh home (nothing cached, offline):
    host facts (numbers, paths) may differ, every topic, status and sentence may not."""
    if Path("/dev/kfd").exists() or Path("/proc/driver/nvidia").exists():
        pytest.skip("README shows a CPU-only machine")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```text\n(\$ [^\n]*preflight[^\n]*)\n(.*?)```", readme, re.S)
    command, shown = block.group(1), block.group(2).splitlines()
    assert command == "$ HF_HUB_OFFLINE=1 quark-ptq-eval preflight --workdir /tmp/qpe-work"
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "XDG_", "QUARK_PTQ_EVAL", "TORCH_EXT", "TRANSFORMERS_OFFLINE"))}
    env |= {"HOME": str(home), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "quark_ptq_eval", "preflight", "--workdir", str(tmp_path / "qpe-work")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr

    def host_neutral(line: str) -> str:
        return re.sub(r"\d+(?:\.\d+)*", "#", re.sub(r"/[^\s:;,)]+", "<path>", line)).rstrip()

    printed = proc.stdout.splitlines()
    # Free disk is the one row that depends on the host's state, not its software: README shows a roomy disk; a
    # host below the limit must say so (with its fix line), and the rest of the screen must still match.
    from quark_ptq_eval.context.preflight import LOW_DISK_GB, free_gb

    if free_gb(tmp_path) < LOW_DISK_GB:
        row = next(i for i, x in enumerate(printed) if x.lstrip().startswith(("ok disk", "!! disk")))
        assert printed[row].lstrip().startswith("!! disk") and "fix:" in printed[row + 1], printed[row:row + 2]
        printed[row:row + 2] = [printed[row].replace("!! disk", "ok disk", 1)]
    assert [host_neutral(x) for x in printed] == [host_neutral(x) for x in shown]


def test_readme_session_is_the_command_make_demo_runs(tmp_path, monkeypatch, capsys):
    """`make demo`'s first lines as README describes them, and the command its transcript shows."""
    from quark_ptq_eval.cli import demo as demo_run

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    session = _section(readme, "## A real session", "## Install")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert "$(PY) -m quark_ptq_eval.cli.demo demo-work" in makefile
    building = re.search(r"`(Building the embedded tiny model and corpus in) <checkout>/demo-work \.\.\.`", session)
    assert building and building.group(1) in Path(demo_run.__file__).read_text(encoding="utf-8")
    root = tmp_path / "demo-work"
    (root / "tiny-llama").mkdir(parents=True)
    (root / "tiny-llama" / "config.json").write_text("{}")  # already built: nothing is trained here
    ran: list[list[str]] = []
    monkeypatch.setattr(demo_run, "cli_main", lambda args: ran.append(args) or 0)
    monkeypatch.chdir(tmp_path)
    assert demo_run.main(["demo-work"]) == 0
    printed = capsys.readouterr().err.strip().replace(f"{root}", "demo-work")
    shown = re.search(r"```text\n(\$ quark-ptq-eval run [^\n]*)", session).group(1)
    assert printed == shown == "$ quark-ptq-eval " + " ".join(ran[0]).replace(f"{root}", "demo-work")
