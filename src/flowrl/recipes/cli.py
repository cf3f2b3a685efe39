"""A recipe's command line, built from its config struct.

Every field of the config becomes a flag (``max_staleness`` -> ``--max-staleness``; a bool
gets ``--x/--no-x``) whose help is the field's description and shows its default. A
:class:`~flowrl.errors.ConfigError` (the config checks itself at construction) becomes
``PROG: error: ...`` on stderr and exit status 2, without a traceback.

``--resume RUN`` continues an earlier run: its saved config is the base, and only the
flags given on the command line override it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from flowrl.errors import ConfigError

__all__ = ["config_errors", "parse_config"]

C = TypeVar("C", bound=msgspec.Struct)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def _parser(
    cls: type[C],
    prog: str,
    description: str,
    *,
    defaults: bool,
    choices: Mapping[str, Sequence[str]],
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=_Formatter)
    for field in msgspec.inspect.type_info(cls).fields:  # type: ignore[attr-defined]
        extra = getattr(field.type, "extra_json_schema", None) or {}
        help_text = extra.get("description", "")
        default = field.default if defaults else argparse.SUPPRESS
        flag = "--" + field.name.replace("_", "-")
        if isinstance(field.default, bool):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        else:
            metavar = {int: "N", float: "X"}.get(type(field.default), "PATH")
            allowed = choices.get(field.name)
            if allowed is not None:  # the help shows {a,b,c}; argparse refuses the rest
                metavar = "{" + ",".join(allowed) + "}"
            parser.add_argument(
                flag,
                type=type(field.default),
                default=default,
                help=help_text,
                metavar=metavar,
                choices=allowed,
            )
    parser.add_argument(
        "--resume",
        metavar="RUN",
        default=argparse.SUPPRESS,
        help="continue the run in folder RUN (an OUT/<timestamp>) from its latest checkpoint; "
        "its config.json is kept, and only the flags you give override it",
    )
    return parser


def parse_config(
    cls: type[C],
    argv: list[str] | None,
    *,
    prog: str,
    description: str,
    read_saved: Callable[[Path], dict[str, Any]],
    choices: Mapping[str, Sequence[str]] | None = None,
) -> tuple[C, str | None]:
    """The config (and ``--resume`` folder) of ``argv``; a bad one exits with status 2.

    ``choices``: the values a string field accepts (its flag's help lists them).
    """
    choices = choices or {}
    parser = _parser(cls, prog, description, defaults=True, choices=choices)
    args = vars(parser.parse_args(argv))
    resume = args.pop("resume", None)
    given = vars(_parser(cls, prog, description, defaults=False, choices=choices).parse_args(argv))
    given.pop("resume", None)
    try:
        if resume is not None:
            saved = read_saved(Path(resume))
            fields = set(cls.__struct_fields__)
            args = {**args, **{k: v for k, v in saved.items() if k in fields}, **given}
        return cls(**args), resume
    except ConfigError as exc:
        parser.error(str(exc))


@contextlib.contextmanager
def config_errors(prog: str) -> Iterator[None]:
    """Turn a :class:`ConfigError` raised in the block into ``PROG: error: ...``, exit 2."""
    try:
        yield
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
