"""A ``multi`` grader's ``calculate_output``: arithmetic over its sub-graders' rewards.

OpenAI's features: numbers, the sub-graders' keys as variables, ``+ - * /``, ``^`` (power;
``**`` is accepted too), parentheses, and the functions ``min max abs floor ceil exp sqrt
log``. The formula is parsed with ``ast`` and evaluated by walking an allow-list of node
types, in floats (so ``9^9^9`` overflows at once instead of building a huge integer);
nothing else (names, attributes, calls, subscripts, comparisons) can appear. ``eval`` is
never used.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Collection, Mapping

MAX_LENGTH = 2000
MAX_NODES = 500

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.Pow: math.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
# name -> (function, fewest arguments, most arguments or None)
FUNCTIONS: dict[str, tuple[Callable[..., float], int, int | None]] = {
    "min": (min, 1, None), "max": (max, 1, None), "abs": (abs, 1, 1), "floor": (math.floor, 1, 1),
    "ceil": (math.ceil, 1, 1), "exp": (math.exp, 1, 1), "sqrt": (math.sqrt, 1, 1), "log": (math.log, 1, 2),
}


class FormulaError(ValueError):
    """A formula that does not parse, or names what it may not."""


class FormulaRuntimeError(ArithmeticError):
    """A formula that parsed but has no value for these rewards (1/0, log(0), overflow)."""


def parse(text: str) -> ast.Expression:
    """The formula's syntax tree (``^`` read as power), or ``FormulaError``."""
    if len(text) > MAX_LENGTH:
        raise FormulaError(f"calculate_output is over {MAX_LENGTH} characters")
    try:
        tree = ast.parse(text.replace("^", "**"), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise FormulaError(f"calculate_output does not parse: {getattr(exc, 'msg', exc)}") from exc
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise FormulaError(f"calculate_output has more than {MAX_NODES} parts")
    return tree


def check(text: str, variables: Collection[str]) -> None:
    """Raise ``FormulaError`` unless ``text`` uses only allowed syntax and ``variables``."""
    _check(parse(text).body, variables)


def _check(node: ast.expr, variables: Collection[str]) -> None:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return
    if isinstance(node, ast.Name):
        if node.id not in variables:
            raise FormulaError(f"calculate_output names '{node.id}', which is no sub-grader "
                               f"(they are: {', '.join(sorted(variables))})")
        return
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        _check(node.operand, variables)
        return
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        _check(node.left, variables)
        _check(node.right, variables)
        return
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS:
        _function, fewest, most = FUNCTIONS[node.func.id]
        if node.keywords or len(node.args) < fewest or (most is not None and len(node.args) > most):
            raise FormulaError(f"calculate_output calls {node.func.id} with the wrong arguments")
        for argument in node.args:
            _check(argument, variables)
        return
    raise FormulaError("calculate_output may use numbers, sub-grader names, + - * / ^, parentheses and "
                       f"{', '.join(FUNCTIONS)}; not '{ast.unparse(node)}'")


def evaluate(text: str, values: Mapping[str, float]) -> float:
    """The formula's value for ``values`` (checked first: ``FormulaError``); a value it does
    not have is ``FormulaRuntimeError``."""
    tree = parse(text)
    _check(tree.body, values)
    try:
        result = _value(tree.body, values)
    except (ZeroDivisionError, OverflowError, ValueError) as exc:
        raise FormulaRuntimeError(f"calculate_output has no value here: {exc}") from exc
    if not math.isfinite(result):
        raise FormulaRuntimeError(f"calculate_output is {result} here")
    return result


def _value(node: ast.expr, values: Mapping[str, float]) -> float:
    if isinstance(node, ast.Constant):
        return float(node.value)
    if isinstance(node, ast.Name):
        return float(values[node.id])
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_value(node.operand, values))
    if isinstance(node, ast.BinOp):
        return float(_BINARY[type(node.op)](_value(node.left, values), _value(node.right, values)))
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    function = FUNCTIONS[node.func.id][0]
    return float(function(*(_value(arg, values) for arg in node.args)))
