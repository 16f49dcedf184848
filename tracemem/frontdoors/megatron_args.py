"""Megatron-LM arguments as its users write them: a command line, ``@file`` argument files and
the functional tests' ``model_config.yaml``, parsed with Megatron's own argument set.

The argument set is data: ``data/megatron_arguments_d98e8a6.json`` holds every argument
``megatron/training/arguments.py`` registers at the pinned commit (its flags, dest, action,
type, default, choices, nargs; tests/tracemem/frontdoors/tools/extract_megatron_arguments.py
made it by running that file's ``add_megatron_arguments``). ``megatron_parser`` rebuilds the
parser from it: Megatron's defaults, ``allow_abbrev=False`` as Megatron's ``parse_args`` sets,
its custom types (``moe_freq_type`` and its kin, ``tuple_type``; enum-typed arguments by
member name), so a value Megatron would refuse is refused here with argparse's message, on one
line.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import json
import operator
import re
import shlex
from importlib import resources
from pathlib import Path
from typing import Any

from tracemem.errors import TracememError
from tracemem.frontdoors.megatron_tables import ARGUMENTS_FILE, PIN

__all__ = ["MegatronArgument", "megatron_arguments", "megatron_parser", "expand_megatron_args",
           "megatron_args_from_yaml", "parse_megatron_args", "parse_with_given",
           "eval_pattern", "run_training_words", "MAX_ARG_FILE_DEPTH"]

MAX_ARG_FILE_DEPTH = 16  # @file inside @file: deeper is a cycle, not a launch script
_WHERE = f"Megatron-LM arguments (megatron/training/arguments.py at {PIN[:7]})"


class MegatronArgument(dict):
    """One record of the JSON (its keys: function, group, flags, dest, action, type,
    default, const, choices, nargs, required, generated_from, help)."""

    @property
    def flag(self) -> str:
        """The first option string, the key of the three tables."""
        return self["flags"][0]


@functools.cache
def megatron_arguments() -> tuple[MegatronArgument, ...]:
    """Every argument of the pinned ``arguments.py``, in registration order."""
    text = resources.files("tracemem.frontdoors").joinpath("data", ARGUMENTS_FILE).read_text()
    data = json.loads(text)
    if data["source"]["commit"] != PIN:
        raise AssertionError(f"{ARGUMENTS_FILE} is from {data['source']['commit']}, not {PIN}")
    return tuple(MegatronArgument(record) for record in data["arguments"])


def eval_pattern(text: str, flag: str) -> list[int]:
    """Megatron's ``_eval_pattern`` (arguments.py): a Python list expression of digits,
    ``[ ] ( ) , + *`` such as ``([0]*3+[1]*58)``, evaluated without ``eval``: only list
    literals of integers, ``+`` of two lists and ``*`` of a list and an integer.

    Raises:
        TracememError: another character or expression, naming ``flag``.
    """
    bad = f"{flag} {text!r} is not a layer pattern such as ([0]*3+[1]*58)"
    if re.search(r"[^,\d\[\]\(\)\+\*\s]", text):
        raise TracememError(bad)
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise TracememError(bad) from None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            items = [value(item) for item in node.elts]
            if all(type(item) is int for item in items):
                return items
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and isinstance(left, list) \
                    and isinstance(right, list):
                return left + right
            if isinstance(node.op, ast.Mult) and {type(left), type(right)} == {list, int}:
                count = left if type(left) is int else right
                if count > 4096:  # more layers than any model (ModelConfig MAX_LAYERS)
                    raise TracememError(f"{flag} {text!r} repeats {count} times; too many")
                return operator.mul(left, right)
        raise TracememError(bad)

    result = value(tree)
    if not isinstance(result, list):
        raise TracememError(bad)
    return result


def _freq_type(flag: str, name: str):
    """``moe_freq_type`` / ``no_rope_freq_type`` / ``la_freq_type``: an int, or a list
    pattern when the text holds ``[``."""
    def convert(text: str):
        try:
            return eval_pattern(text, flag) if "[" in text else int(text)
        except TracememError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    convert.__name__ = name  # argparse names it in "invalid <name> value"
    return convert


def tuple_type(text: str) -> tuple[int, ...]:
    """Megatron's ``tuple_type``: ``"1,2"`` or ``"(1,2)"`` -> ``(1, 2)``."""
    return tuple(int(i) for i in text.strip("()").split(","))


def _bool_type(text: str) -> bool:
    return bool(text)  # argparse's type=bool, as Megatron registers --onnx-safe


_TYPES = {"int": int, "float": float, "str": str, "bool": _bool_type,
          "tuple_type": tuple_type, "_parse_cuda_graph_modules_arg": str}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own message, on one line
        raise TracememError(f"{_WHERE}: {message}")


def _build(default_suppressed: bool) -> _Parser:
    parser = _Parser(prog="megatron", allow_abbrev=False, add_help=False)
    for record in megatron_arguments():
        kwargs: dict[str, Any] = {"dest": record["dest"]}
        action = record["action"]
        if action in ("store_true", "store_false"):
            kwargs["action"] = action
        elif action == "BooleanOptionalAction":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kind = record["type"]
            if kind in ("moe_freq_type", "no_rope_freq_type", "la_freq_type"):
                kwargs["type"] = _freq_type(record.flag, kind)
            elif kind and kind.startswith("enum"):
                kwargs["type"] = str  # by member name, as ArgumentGroupFactory parses them
            elif kind:
                kwargs["type"] = _TYPES[kind]
            if record["nargs"] is not None:
                kwargs["nargs"] = record["nargs"]
            if record["choices"] is not None:
                kwargs["choices"] = record["choices"]
        kwargs["default"] = argparse.SUPPRESS if default_suppressed else record["default"]
        parser.add_argument(*record["flags"], **kwargs)
    return parser


@functools.cache
def megatron_parser() -> argparse.ArgumentParser:
    """An ``argparse`` parser of every pinned argument, with Megatron's defaults."""
    return _build(False)


@functools.cache
def _given_parser() -> argparse.ArgumentParser:
    return _build(True)


@functools.cache
def _option_strings() -> tuple[str, ...]:
    return tuple(f for record in megatron_arguments() for f in record["flags"])


def _check_known(argv: list[str]) -> None:
    known = set(_option_strings())
    for token in argv:
        if not token.startswith("-") or re.fullmatch(r"-[0-9.eE+-]+", token):
            continue  # a value, a negative number
        flag = token.split("=", 1)[0]
        if flag not in known:
            # a shortened flag: Megatron's parser takes no abbreviations (allow_abbrev=False
            # in arguments.py parse_args), so name the flags it begins
            # 0.8, as tracemem's own flags (cli._check_flag_names): a typo, not a guess
            close = difflib.get_close_matches(flag, _option_strings(), n=1, cutoff=0.8)
            longer = sorted((f for f in known if f.startswith(flag) and len(flag) > 2),
                            key=lambda f: (len(f), f))
            if longer and not (close and close[0] in longer):
                shown = ", ".join(longer[:3]) + (f" ({len(longer)} in all)"
                                                 if len(longer) > 3 else "")
                raise TracememError(f"unknown Megatron-LM argument {flag} (Megatron-LM takes "
                                    f"no abbreviations); did you mean {shown}?")
            raise TracememError(f"unknown Megatron-LM argument {flag} (not in "
                                f"megatron/training/arguments.py at {PIN[:7]})"
                                + (f"; did you mean {close[0]}?" if close else ""))


def expand_megatron_args(argv, _depth: int = 0) -> list[str]:
    """``argv`` with every ``@file`` replaced by the arguments the file holds (argparse's
    ``fromfile_prefix_chars="@"``, read as a launch script writes them: several arguments to
    a line, shell quoting, ``#`` comments; a file may name another ``@file``). Relative paths
    are relative to the working directory, as argparse opens them.

    Raises:
        TracememError: a file that cannot be read, unbalanced quotes, or @files nested more
            than ``MAX_ARG_FILE_DEPTH`` deep (a cycle).
    """
    if isinstance(argv, str):
        raise TracememError("Megatron-LM arguments must be a list of strings, not one string; "
                            "split it (shlex.split) or pass @file")
    out: list[str] = []
    for token in argv:
        token = str(token)
        if not token.startswith("@") or len(token) == 1:
            out.append(token)
            continue
        path = Path(token[1:])
        if _depth >= MAX_ARG_FILE_DEPTH:
            raise TracememError(f"{token}: argument files nested more than "
                                f"{MAX_ARG_FILE_DEPTH} deep (an @file that names itself?)")
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise TracememError(f"{token}: no such Megatron-LM argument file") from None
        except (OSError, UnicodeDecodeError) as error:
            raise TracememError(f"{token}: cannot read the argument file: "
                                f"{type(error).__name__}: {error}") from None
        # a launch script's lines continued with a backslash, as --print-megatron-args
        # writes them: the continuation is a space
        text = re.sub(r"\\\r?\n", " ", text)
        try:
            words = shlex.split(text, comments=True)
        except ValueError as error:  # "No closing quotation"
            raise TracememError(f"{token}: {error}") from None
        out += expand_megatron_args(words, _depth + 1)
    return out


class _YamlLoader:
    """PyYAML's SafeLoader with YAML 1.2 scalars: only true / false are booleans and numbers
    stay as written (``1e-6``, ``.01``, ``0001``), as ``yq`` hands them to Megatron-LM's
    test runner (tests/functional_tests/shell_test_utils/_run_training.sh)."""

    @staticmethod
    @functools.cache
    def loader():
        import yaml

        class Loader(yaml.SafeLoader):
            pass

        Loader.yaml_implicit_resolvers = {
            key: [(tag, regexp) for tag, regexp in resolvers
                  if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float",
                                 "tag:yaml.org,2002:bool", "tag:yaml.org,2002:timestamp")]
            for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
        Loader.add_implicit_resolver("tag:yaml.org,2002:bool",
                                     re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                     list("tTfF"))
        return Loader


def _yaml_value(value) -> str:
    if value is True:
        return "true"
    if value is False:
        return "false"
    return str(value)


def _xargs_echo(text: str, key: str) -> str:
    """``echo "$value" | xargs``: GNU findutils xargs with no command echoes its items, read
    as its default input format does: items separated by blanks and newlines, single and
    double quotes grouping (and removed), a backslash outside quotes taking the next character
    as it is; echo joins them with one space.

    Raises:
        TracememError: an unmatched quote (xargs stops: "unmatched double quote").
    """
    items: list[str] = []
    item: list[str] = []
    quote, started, i = None, False, 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == quote:
                quote = None
            else:
                item.append(ch)
        elif ch in "'\"":
            quote, started = ch, True
        elif ch == "\\" and i + 1 < len(text):
            item.append(text[i + 1])
            started = True
            i += 1
        elif ch in " \t\n":
            if started or item:
                items.append("".join(item))
            item, started = [], False
        else:
            item.append(ch)
        i += 1
    if quote:
        kind = "double" if quote == '"' else "single"
        raise TracememError(f"MODEL_ARGS {key}: unmatched {kind} quote in {text!r} (the test "
                            f"runner's xargs stops there)")
    if started or item:
        items.append("".join(item))
    return " ".join(items)


def _double_quoted(value: str) -> str:
    """A word inside double quotes under bash: a backslash escapes only $, `, ", \\ and a
    newline."""
    return re.sub(r'\\([$`"\\\n])', r"\1", value)


# Megatron-LM 7418b1b8fb (2026-02-26) made _run_training.sh double-quote a value with a
# shell metacharacter (|, ( or )), and rewrote the model_config.yaml files that had escaped
# them with backslashes
RUNNER_QUOTES_METACHARACTERS = "7418b1b8fb"


def run_training_words(key: str, text: str, *, quote_metacharacters: bool = True
                       ) -> list[str]:
    """The command-line words after ``key`` that Megatron-LM's functional-test runner makes of
    a MODEL_ARGS value printed as ``text`` (tests/functional_tests/shell_test_utils/
    _run_training.sh at d98e8a6: ``value="$(echo "$value" | xargs)"``, then by its form
    ``$key "$value"`` for ``(...)`` or a value with a space or a shell metacharacter
    (``|``, ``(``, ``)``), ``$key $value`` for ``[...]`` with the brackets stripped and for
    anything else, and ``eval "TRAINING_PARAMS_ARRAY=(...)"``): xargs takes one level of
    quotes and backslashes, and the eval's word splitting another where the value is not
    double-quoted. ``quote_metacharacters=False`` is the runner before
    ``RUNNER_QUOTES_METACHARACTERS``, which double-quoted only a value with a space: there
    ``Et*3\\\\|\\\\(tt\\\\|\\\\)*6tL`` in a YAML plain scalar reaches Megatron as ``Et*3|(tt|)*6tL``.
    ``${...}`` placeholders stay as written (the runner substitutes them first; they are
    paths). Not modelled: the eval's globbing of an unquoted ``*`` against the files where it
    runs (none match in the CI's directory).

    Raises:
        TracememError: an unmatched quote (xargs or the eval).
    """
    value = _xargs_echo(text, key)
    bracketed = re.fullmatch(r"\[[^]]+\]", value)
    special = " |()" if quote_metacharacters else " "
    if re.fullmatch(r"\([^)]+\)", value) or (
            not bracketed and any(ch in value for ch in special)):
        return [_double_quoted(value)]
    if bracketed:
        value = value[1:-1]
    try:
        return shlex.split(value)
    except ValueError as error:
        raise TracememError(f"MODEL_ARGS {key}: {error} in {value!r} (the test runner's eval "
                            f"stops there)") from None


def megatron_args_from_yaml(path) -> tuple[list[str], dict[str, str]]:
    """The arguments and environment of a Megatron-LM functional test's
    ``model_config.yaml`` (``MODEL_ARGS``, ``ENV_VARS``), as its runner
    (tests/functional_tests/shell_test_utils/_run_training.sh at d98e8a6) turns them into a
    command line: ``true`` is the bare flag, a list several values, any other value the words
    its xargs and eval make of it (``run_training_words``: a value in ``[...]`` several, one
    in ``(...)`` or with a space or ``|``, ``(``, ``)`` one); ``false`` and an empty value
    leave the flag out. Placeholders such as ``${DATA_PATH}`` stay as written (they are
    paths).

    Raises:
        TracememError: a file that is not readable YAML, no ``MODEL_ARGS`` mapping, a key that
            is not a ``--flag``, a null value, a value with an unmatched quote.
    """
    import yaml

    where = f"{path}"
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise TracememError(f"{where}: no such model_config.yaml") from None
    except IsADirectoryError:
        raise TracememError(f"{where} is a folder; give the model_config.yaml file in it"
                            ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise TracememError(f"{where}: cannot read: {type(error).__name__}: {error}") from None
    try:
        data = yaml.load(text, Loader=_YamlLoader.loader())
    except yaml.YAMLError as error:
        first = " ".join(str(error).split())
        raise TracememError(f"{where}: malformed YAML: {first}") from None
    if not isinstance(data, dict) or not isinstance(data.get("MODEL_ARGS"), dict):
        raise TracememError(f"{where}: no MODEL_ARGS mapping (a Megatron-LM functional test's "
                            f"model_config.yaml has MODEL_ARGS and ENV_VARS)")
    args: list[str] = []
    for key, value in data["MODEL_ARGS"].items():
        key = str(key)
        if not key.startswith("--"):
            raise TracememError(f"{where}: MODEL_ARGS key {key!r} is not a Megatron-LM "
                                f"argument (--flag)")
        if value is None:
            raise TracememError(f"{where}: MODEL_ARGS {key} has no value; give true, a value, "
                                f"or leave it out")
        if value is True:
            args.append(key)
        elif value is False or value == "":
            continue
        elif isinstance(value, list):
            args += [key, *(_yaml_value(v) for v in value)]
        else:
            args += [key, *run_training_words(key, _yaml_value(value))]
    env_data = data.get("ENV_VARS") or {}
    if not isinstance(env_data, dict):
        raise TracememError(f"{where}: ENV_VARS is not a mapping")
    env = {str(k): _yaml_value(v) for k, v in env_data.items()}
    return args, env


def parse_with_given(argv) -> tuple[argparse.Namespace, set[str]]:
    """``parse_megatron_args`` and the dests the arguments gave (with any value)."""
    argv = expand_megatron_args(argv)
    _check_known(argv)
    given = vars(_given_parser().parse_args(argv))
    namespace = megatron_parser().parse_args(argv)
    return namespace, set(given)


def parse_megatron_args(argv, env=None) -> argparse.Namespace:
    """``argv`` (``@file`` expanded) parsed as Megatron-LM's ``parse_args`` parses it: every
    pinned argument, with Megatron's defaults (an enum-typed argument holds its member's name,
    ``--attention-backend`` "auto"). ``env`` (ENV_VARS) is taken for symmetry with the YAML
    path; ``megatron_job_kwargs`` checks it.

    Raises:
        TracememError: an unknown flag (with the closest known one), or a value argparse
            refuses (its message), on one line.
    """
    del env
    return parse_with_given(argv)[0]
