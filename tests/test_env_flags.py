"""Every server flag from a SLUICE_* variable: parsed as the flag is, named in the error when it
is bad, beaten by the command line, and listed in docs/configuration.md's table."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from frontend.cli import build_parser, environment_table
from frontend.env_flags import apply_env_defaults, env_name


def parser(environ: dict[str, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--scheduling-policy", default="priority", choices=["fcfs", "priority"])
    p.add_argument("--enable-prefix-caching", default=True, action=argparse.BooleanOptionalAction)
    p.add_argument("--model", default="smollm2")
    apply_env_defaults(p, environ)
    return p


def test_variables_set_defaults_and_the_command_line_wins() -> None:
    env = {"SLUICE_MAX_NUM_SEQS": "8", "SLUICE_ENABLE_PREFIX_CACHING": "off", "SLUICE_MODEL": "tiny",
           "SLUICE_SCHEDULING_POLICY": "fcfs"}
    args = parser(env).parse_args([])
    assert (args.max_num_seqs, args.enable_prefix_caching, args.model, args.scheduling_policy) == (8, False, "tiny", "fcfs")
    args = parser(env).parse_args(["--max-num-seqs", "3", "--enable-prefix-caching"])
    assert (args.max_num_seqs, args.enable_prefix_caching) == (3, True)
    assert parser({}).parse_args([]).max_num_seqs == 256
    assert parser({"SLUICE_MAX_NUM_SEQS": "", "SLUICE_MODEL": ""}).parse_args([]).model == "smollm2"  # empty = unset
    assert "[env SLUICE_MAX_NUM_SEQS]" in parser({}).format_help()


@pytest.mark.parametrize(("name", "value", "says"), [
    ("SLUICE_MAX_NUM_SEQS", "many", "SLUICE_MAX_NUM_SEQS='many'"),
    ("SLUICE_ENABLE_PREFIX_CACHING", "perhaps", "expected one of 1, true"),
    ("SLUICE_SCHEDULING_POLICY", "lottery", "expected one of fcfs, priority"),
])
def test_a_bad_value_is_an_error_naming_the_variable(name: str, value: str, says: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parser({name: value})
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err


def test_the_real_commands_take_their_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_MAX_NUM_SEQS_PER_PRIORITY", "5:2")
    monkeypatch.setenv("SLUICE_ADDRESS", "tcp://scheduler:6000")
    monkeypatch.setenv("SLUICE_ADMIN_TOKEN", "s3cret")
    args = build_parser(env_command="scheduler").parse_args(["scheduler"])
    assert args.max_num_seqs_per_priority == {5: 2} and args.address == "tcp://scheduler:6000"
    assert build_parser(env_command="frontend").parse_args(["frontend"]).admin_token == "s3cret"
    sub = next(a for a in build_parser(env_command="frontend")._actions if isinstance(a, argparse._SubParsersAction))
    assert "s3cret" not in sub.choices["frontend"].format_help()  # the token never shows


def test_a_bad_variable_breaks_only_the_command_that_reads_it(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SLUICE_MAX_NUM_SEQS", "many")
    assert build_parser(env_command="frontend").parse_args(["frontend"]).port == 8000  # takes no such flag
    assert build_parser(env_command="bench").parse_args(["bench"]).command == "bench"
    with pytest.raises(SystemExit):
        build_parser(env_command="scheduler")
    assert "sluice scheduler: error: SLUICE_MAX_NUM_SEQS='many'" in capsys.readouterr().err


def test_a_kubernetes_service_link_is_not_a_port(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # A Kubernetes Service named "sluice" puts SLUICE_PORT=tcp://IP:PORT in every pod's environment.
    monkeypatch.setenv("SLUICE_PORT", "tcp://10.0.0.7:8000")
    assert build_parser(env_command="serve").parse_args(["serve"]).port == 8000
    assert "ignoring SLUICE_PORT=tcp://10.0.0.7:8000" in capsys.readouterr().err
    monkeypatch.setenv("SLUICE_PORT", "9000")
    assert build_parser(env_command="serve").parse_args(["serve"]).port == 9000


def test_the_configuration_page_lists_every_variable() -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    names = re.findall(r"`(SLUICE_[A-Z_]+)`", environment_table())
    assert len(names) > 30
    missing = [n for n in names if f"`{n}`" not in page]
    assert not missing, f"docs/configuration.md lacks {missing}: paste python -c 'from frontend.cli import environment_table; " \
                        "print(environment_table())'"
    assert env_name("--max-num-seqs") == "SLUICE_MAX_NUM_SEQS"
