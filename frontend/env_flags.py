"""Every flag of a server command from the environment: ``--max-num-seqs`` is ``SLUICE_MAX_NUM_SEQS``.

A set variable becomes the flag's default, so a flag on the command line still wins; an empty one
counts as unset (what a compose file's ``${X:-}`` gives when ``X`` is not set). It is parsed
as the flag would be (type, choices), and a bad value is an error naming the variable. Switches
(``--enable-prefix-caching`` / ``--no-enable-prefix-caching``) take 1/0, true/false, yes/no or
on/off. Containers and compose files set these variables instead of writing command lines.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

PREFIX = "SLUICE_"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_name(option: str) -> str:
    """``--max-num-seqs`` -> ``SLUICE_MAX_NUM_SEQS``."""
    return PREFIX + option.lstrip("-").replace("-", "_").upper()


def _flag_actions(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    # argparse has no public way to list a parser's arguments; _actions is stable across versions.
    out = []
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
        if longs and not isinstance(action, argparse._HelpAction):
            out.append((longs[0], action))
    return out


def _parse(parser: argparse.ArgumentParser, name: str, action: argparse.Action, raw: str) -> object:
    if isinstance(action, argparse.BooleanOptionalAction):
        if raw.strip().lower() in TRUE:
            return True
        if raw.strip().lower() in FALSE:
            return False
        parser.error(f"{name}={raw!r}: expected one of {', '.join(TRUE + FALSE)}")
    try:
        value = action.type(raw) if callable(action.type) else raw
    except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
        parser.error(f"{name}={raw!r}: {e}")
    if action.choices is not None and value not in action.choices:
        parser.error(f"{name}={raw!r}: expected one of {', '.join(map(str, action.choices))}")
    return value


def _service_link(name: str, raw: str) -> bool:
    """Kubernetes (and Docker's --link) give every container of a Service named ``sluice`` the
    variable SLUICE_PORT=tcp://10.0.0.7:8000: an address, never a port number meant for us."""
    return name.endswith("_PORT") and raw.startswith(("tcp://", "udp://"))


def apply_env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Name each flag's variable in its help, and take its default from the variable when set
    (``environ={}``: only name them)."""
    env = os.environ if environ is None else environ
    for option, action in _flag_actions(parser):
        name = env_name(option)
        action.help = f"{action.help or ''} [env {name}]"
        raw = env.get(name)
        if not raw:
            continue
        if _service_link(name, raw):
            print(f"sluice: ignoring {name}={raw}: a service link's address (Kubernetes sets it for a Service "
                  f"named sluice), not a port", file=sys.stderr)
            continue
        action.default = _parse(parser, name, action, raw)


def env_table(parsers: Mapping[str, argparse.ArgumentParser]) -> str:
    """A Markdown table of every variable: its flag and the commands that take it."""
    rows: dict[str, tuple[str, list[str]]] = {}
    for command, parser in parsers.items():
        for option, _ in _flag_actions(parser):
            rows.setdefault(env_name(option), (option, []))[1].append(command)
    lines = ["| variable | flag | commands |", "|---|---|---|"]
    lines += [f"| `{name}` | `{flag}` | {', '.join(commands)} |" for name, (flag, commands) in sorted(rows.items())]
    return "\n".join(lines)
