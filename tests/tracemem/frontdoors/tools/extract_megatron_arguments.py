"""Extract every argument Megatron-LM's ``megatron/training/arguments.py`` registers, as data.

How ``tracemem/frontdoors/data/megatron_arguments_<commit>.json`` was made::

    # a bare clone of github.com/NVIDIA/Megatron-LM, at the pinned commit
    mkdir /tmp/mlm && git -C MEGATRON_GIT archive d98e8a64ddf34856e74b24714e3bedb2f5a39553 \\
        megatron | tar -x -C /tmp/mlm
    .venv/bin/python tests/tracemem/frontdoors/tools/extract_megatron_arguments.py \\
        /tmp/mlm d98e8a64ddf34856e74b24714e3bedb2f5a39553 2026-08-22 \\
        > tracemem/frontdoors/data/megatron_arguments_d98e8a6.json

Why the parser is run rather than the file read with ``ast``: at that commit most arguments are
not written as ``add_argument('--flag', ...)`` calls. ``_add_network_size_args``,
``_add_training_args``, ``_add_distributed_args`` and others call
``megatron.training.argument_utils.ArgumentGroupFactory(SomeConfig).build_group(parser)``, which
turns every field of a dataclass (``TransformerConfig``: 236 at d98e8a6; ``TrainingConfig``,
``CheckpointConfig``, ``LoggerConfig``, ...) into a flag, its type, default and
``--no-`` / ``--disable-`` names generated from the field. So the script imports the pinned
``megatron.training.arguments``, calls its own ``add_megatron_arguments`` on a fresh parser, and
reads ``parser._actions``; each ``_add_*_args`` function is wrapped to record which actions it
added (the group a reader finds the flag in), and ``ArgumentGroupFactory.build_group`` to record
the dataclass an argument was generated from.

Then the literal ``add_argument('--flag'`` calls of the file are read with ``ast`` as a check:
a literal flag the run did not register is one registered only when an optional package is
installed (``_add_kitchen_quantization_arguments``: only with NVIDIA kitchen); those are added
from the ``ast`` with ``"conditional": true``.

Imports: the pinned tree imports ``triton`` in three kernel modules (paged stash, two Mamba
ops) that argument registration never uses; they are replaced by empty stand-ins
(``STUB_MODULES``); ``typing.override`` (Python 3.12) is given to Python 3.11 as the identity.
Nothing else is stubbed: every dataclass and function that registers an argument is Megatron's
own code at that commit.
"""

from __future__ import annotations

import argparse
import ast
import enum
import importlib.abc
import importlib.machinery
import json
import sys
import types
import typing

STUB_MODULES = (
    "megatron.core.transformer.moe.ops.paged_stash",
    "megatron.core.ssm.ops.common.causal_conv1d_varlen",
    "megatron.core.ssm.ops.mamba2.batch_invariant_decode",
)


class _Anything:
    """Any attribute, call, base class or iteration of a stubbed module."""

    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:  # used as a decorator
            return args[0]
        return _Anything(self._name + "()")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self._name}.{name}")

    def __mro_entries__(self, bases):
        return (object,)

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if any(name == s or name.startswith(s + ".") for s in STUB_MODULES):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _json_value(value):
    """A default / const / choice as JSON: enums by name, tuples as lists, anything else that
    JSON cannot hold as {"repr": ...}."""
    if isinstance(value, enum.Enum):
        return value.name
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    return {"repr": repr(value)}


_ACTIONS = {
    argparse._StoreAction: "store", argparse._StoreTrueAction: "store_true",
    argparse._StoreFalseAction: "store_false", argparse._StoreConstAction: "store_const",
    argparse._AppendAction: "append", argparse._AppendConstAction: "append_const",
    argparse._CountAction: "count",
}


def _type_name(action) -> str | None:
    kind = action.type
    if kind is None:
        return None
    if getattr(kind, "__name__", "") == "enum_type_handler":  # ArgumentGroupFactory enums
        enum_cls = type(action.choices[0]) if action.choices else None
        return f"enum:{enum_cls.__name__}" if enum_cls else "enum"
    return getattr(kind, "__name__", repr(kind))


def _literal_flags(source: str) -> dict[str, dict]:
    """Literal ``add_argument('--flag', ...)`` calls: option string -> the ``_add_*`` function
    and the call's literal ``type`` (a name), ``default``, ``action`` and ``help``."""
    found = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for call in ast.walk(node):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "add_argument"):
                keywords = {k.arg: k.value for k in call.keywords}
                literal = {"function": node.name, "type": None, "default": None,
                           "action": "store", "help": ""}
                if isinstance(keywords.get("type"), ast.Name):
                    literal["type"] = keywords["type"].id
                for key in ("default", "action", "help"):
                    if isinstance(keywords.get(key), ast.Constant):
                        literal[key] = keywords[key].value
                for arg in call.args:
                    if isinstance(arg, ast.Constant) and str(arg.value).startswith("-"):
                        found[arg.value] = literal
    return found


def main(root: str, commit: str, date: str) -> None:
    if not hasattr(typing, "override"):
        typing.override = lambda f: f
    sys.meta_path.insert(0, _StubFinder())
    sys.path.insert(0, root)
    import megatron.training.argument_utils as argument_utils
    import megatron.training.arguments as arguments

    current: dict[str, object] = {"function": None, "dataclass": None}
    origin: dict[int, tuple[str, str | None]] = {}

    build_group = argument_utils.ArgumentGroupFactory.build_group

    def recording_build_group(self, parser, title=None):
        before = {id(a) for a in parser._actions}
        group = build_group(self, parser, title)
        for action in parser._actions:
            if id(action) not in before:
                origin[id(action)] = (current["function"], self.src_cfg_class.__name__)
        return group

    argument_utils.ArgumentGroupFactory.build_group = recording_build_group

    for name in dir(arguments):
        function = getattr(arguments, name)
        if not (name.startswith("_add_") and callable(function)):
            continue

        def wrapped(parser, _function=function, _name=name):
            before = {id(a) for a in parser._actions}
            outer = current["function"]
            current["function"] = _name
            try:
                result = _function(parser)
            finally:
                current["function"] = outer
            for action in parser._actions:
                if id(action) not in before and id(action) not in origin:
                    origin[id(action)] = (_name, None)
            return result

        setattr(arguments, name, wrapped)

    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    arguments.add_megatron_arguments(parser)
    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}

    records = []
    registered = set()
    for action in parser._actions:
        function, dataclass = origin[id(action)]
        registered.update(action.option_strings)
        records.append({
            "function": function,
            "group": group_of.get(id(action)),
            "flags": list(action.option_strings),
            "dest": action.dest,
            "action": _ACTIONS.get(type(action), type(action).__name__),
            "type": _type_name(action),
            "default": _json_value(action.default),
            "const": _json_value(action.const),
            "choices": None if action.choices is None else _json_value(list(action.choices)),
            "nargs": action.nargs,
            "required": action.required,
            "generated_from": dataclass,
            "help": action.help or "",
        })

    source_path = f"{root}/megatron/training/arguments.py"
    with open(source_path) as handle:
        literal = _literal_flags(handle.read())
    for flag, call in literal.items():  # in the file's order
        if flag in registered:
            continue
        records.append({
            "function": call["function"], "group": None, "flags": [flag],
            "dest": flag.lstrip("-").replace("-", "_"), "action": call["action"],
            "type": call["type"], "default": call["default"], "const": None, "choices": None,
            "nargs": None, "required": False, "generated_from": None,
            "help": " ".join(call["help"].split()), "conditional": True,
        })

    source = {"repository": "https://github.com/NVIDIA/Megatron-LM", "commit": commit,
              "date": date, "file": "megatron/training/arguments.py",
              "entry": "add_megatron_arguments",
              "made_by": "tests/tracemem/frontdoors/tools/extract_megatron_arguments.py",
              "license": "Apache-2.0 (Megatron-LM); help texts are Megatron-LM's"}
    # one argument per line, in registration order: diffs between two pins read line by line
    sys.stdout.write('{"source": ' + json.dumps(source) + ',\n "arguments": [\n')
    sys.stdout.write(",\n".join("  " + json.dumps(record) for record in records))
    sys.stdout.write("\n]}\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
