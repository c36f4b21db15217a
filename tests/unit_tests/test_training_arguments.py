"""Megatron-LM's argument builder on the patched core: every callable config field is left out.

``megatron/training/arguments.py`` builds its command-line flags from ``TransformerConfig``'s
fields (``ArgumentGroupFactory``) and lists the fields it cannot parse, the callables, in
``_add_network_size_args``'s ``exclude``; a callable field missing there makes every
Megatron-LM training script fail at argument parsing (``TypeInferenceError: Unsupported
type: typing.Callable``; upstream's ``test_op_fuser_transformer_config_args_are_exposed``
caught it). The module needs Python 3.12, so the check reads its source.
"""

import ast
import dataclasses
import importlib.util
import os
import typing

from megatron.core.transformer.transformer_config import TransformerConfig


def _excluded_fields() -> set:
    spec = importlib.util.find_spec("megatron.core")
    path = os.path.join(os.path.dirname(spec.origin), "..", "training", "arguments.py")
    tree = ast.parse(open(path).read())
    (function,) = [node for node in ast.walk(tree)
                   if isinstance(node, ast.FunctionDef) and node.name == "_add_network_size_args"]
    (exclude,) = [node.value for node in ast.walk(function) if isinstance(node, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "exclude" for t in node.targets)]
    return {element.value for element in exclude.elts}


def _is_callable(annotation) -> bool:
    if annotation is typing.Callable or getattr(annotation, "__origin__", None) is typing.Callable.__origin__:
        return True
    return any(_is_callable(arg) for arg in getattr(annotation, "__args__", ()) if arg is not type(None))


class TestTrainingArguments:
    def test_every_callable_config_field_is_excluded_from_the_flags(self):
        hints = typing.get_type_hints(TransformerConfig)
        callables = {field.name for field in dataclasses.fields(TransformerConfig)
                     if field.init and _is_callable(hints[field.name])}
        assert "microbatch_prefetch_func" in callables  # the series' own hook
        assert callables - _excluded_fields() == set()
