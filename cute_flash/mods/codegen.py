"""A `ModGraph` emitted as CuTe DSL code: `emit` walks the nodes at trace time on DSL scalars (Float32 for the score,
Int32 for the indices) and returns the result's DSL value, so a kernel calls it once per score element in place of
the user's callable. Captured tensors are the kernel's `aux` arguments (global-memory cute.Tensors, in the graph's
aux order); a read is one scalar load, converted to float32 / int32 / bool.

Semantics match `graph.evaluate` in float32: Python / torch floor division and remainder on indices (the DSL's
own), truncation toward zero for float -> int casts (torch's .int()), IEEE division (of a quantity that depends on
the score by a constant: a product with its float32 reciprocal, within 1 ulp; divisions of positions stay exact,
since a mask's floor(q_idx / 41.0) must be), and the math functions of `cute.math` (exp / exp2 / log / log2 / sin /
cos by their fast approximations where the DSL picks them; tanh by the hardware's tanh.approx.f32, relative error about
2^-11, far below the bf16 / fp16 scores' own rounding, as the softcap feature's; sigmoid as 1 / (1 + exp(-x)), pow
as exp2(y * log2(x)) for x > 0 with the sign fixed for integral y, as `graph.evaluate`'s torch.pow gives for the
finite values a score takes). A float conversion of a sum or difference of two index inputs / integer constants is
the sum or difference of their conversions (exact: positions are below 2^24, mods/call.py checks), so that a
relative position (ALiBi's q_idx - kv_idx) costs one conversion per row and per column, not per score.
Out-of-range reads of a captured tensor are the kernel's: positions past a sequence must be clamped before `emit`
(block_mask.py does the same on the host).
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32

from ..common.softcap import tanh_approx
from .graph import BOOL, F32, I32, ModGraph, Node

_CONVERT = {F32: Float32, I32: Int32, BOOL: Boolean}


def _select(cond, a, b, type_: str):
    return _CONVERT[type_](cutlass.select_(cond, a, b))


def _cast(x, to: str):
    if to == BOOL:
        return Boolean(x != 0) if not isinstance(x, Boolean) else x
    return _CONVERT[to](x)


def _load(tensor: cute.Tensor, index: List, type_: str):
    value = tensor[tuple(index)] if index else tensor[0]
    if type_ == BOOL:
        return Boolean(value != 0)
    return _CONVERT[type_](value)


def _pow(x, y):
    # exp2(y log2|x|), negative for a negative base and an odd integral exponent (NaN for other negative bases,
    # as torch.pow).
    mag = cute.math.exp2(y * cute.math.log2(cute.math.abs(x)))
    y_int = cute.math.floor(y) == y
    odd = y_int & (cute.math.abs(y - Float32(2.0) * cute.math.floor(y * Float32(0.5))) == Float32(1.0))
    neg = x < Float32(0.0)
    signed = _select(odd, -mag, mag, F32)
    value = _select(neg, _select(y_int, signed, Float32(float("nan")), F32), mag, F32)
    return _select(y == Float32(0.0), Float32(1.0), value, F32)  # x ** 0 = 1 for every x, as torch.pow


_UNARY_DSL = {
    "neg": lambda x: -x,
    "exp": lambda x: cute.math.exp(x),
    "exp2": lambda x: cute.math.exp2(x),
    "log": lambda x: cute.math.log(x),
    "log2": lambda x: cute.math.log2(x),
    "sqrt": lambda x: cute.math.sqrt(x),
    "rsqrt": lambda x: cute.math.rsqrt(x),
    "tanh": tanh_approx,
    "sin": lambda x: cute.math.sin(x),
    "cos": lambda x: cute.math.cos(x),
    "sigmoid": lambda x: Float32(1.0) / (Float32(1.0) + cute.math.exp(-x)),
}
_BINARY_DSL = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "truediv": lambda a, b: a / b,
    "floordiv": lambda a, b: a // b,
    "mod": lambda a, b: a - (a // b) * b,  # Python's / torch.remainder's sign (the divisor's), from the floor division
    "pow": _pow,
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "and": lambda a, b: a & b,
    "or": lambda a, b: a | b,
    "xor": lambda a, b: a ^ b,
}


_EXACT_INT = 1 << 24  # integers of smaller magnitude convert to float32 exactly
MAX_PRODUCT_POWER = 8  # x ** n for a constant whole n up to this: repeated products (exact squares of positions)


def _small_int(node: Node) -> bool:
    """An index input or an integer constant that converts to float32 exactly (positions: below 2^24)."""
    return node.type == I32 and (node.op == "input" or (node.op == "const" and abs(int(node.args[0])) < _EXACT_INT))


def _emit_node(
    node: Node, vals: List, inputs: Dict[str, object], aux: Sequence[cute.Tensor], nodes: Sequence[Node],
    score_dependent: bool,
):  # fmt: skip
    a, t = node.args, node.type
    if node.op == "input":
        return _CONVERT[t](inputs[a[0]])
    if node.op == "const":
        return Float32(float.fromhex(a[0])) if t == F32 else _CONVERT[t](a[0])
    if node.op == "load":
        return _load(aux[a[0]], [vals[i] for i in a[1:]], t)
    if node.op == "cast":
        src = nodes[a[0]]
        if a[1] == F32 and src.op in ("add", "sub") and all(_small_int(nodes[i]) for i in src.args):
            x, y = (Float32(vals[i]) for i in src.args)  # (see the module's docstring)
            return x + y if src.op == "add" else x - y
        return _cast(vals[a[0]], a[1])
    if node.op == "where":
        return _select(vals[a[0]], vals[a[1]], vals[a[2]], t)
    xs = [vals[i] for i in a]
    if node.op == "abs":
        x = xs[0]
        return _select(x < _CONVERT[t](0), -x, x, t)
    if node.op in ("floor", "ceil"):
        return xs[0] if t == I32 else Float32(getattr(cute.math, node.op)(xs[0]))
    if node.op == "not":
        return Boolean(xs[0] == Boolean(False))
    if node.op in ("maximum", "minimum"):
        x, y = xs
        pick = _select(x > y if node.op == "maximum" else x < y, x, y, t)  # (y when y is NaN)
        return pick if t == I32 else _select(x != x, x, pick, t)  # and x when x is NaN: torch propagates NaN
    if node.op in _UNARY_DSL:
        return _CONVERT[t](_UNARY_DSL[node.op](xs[0]))
    if node.op == "pow":
        n = _constant_value(nodes, a[1])
        if n is not None and n == int(n) and 0 <= n <= MAX_PRODUCT_POWER:  # x * x * ...: exact where the value is
            value = Float32(1.0)
            for _ in range(int(n)):
                value = value * Float32(xs[0])
            return value
    if node.op == "truediv" and score_dependent:
        divisor = _constant_value(nodes, a[1])
        if divisor is not None and 2.0**-125 < abs(divisor) < 2.0**125:  # (a normal reciprocal)
            return Float32(xs[0]) * Float32(1.0 / divisor)
    return _CONVERT[t](_BINARY_DSL[node.op](xs[0], xs[1]))


def _constant_value(nodes: Sequence[Node], i: int):
    """The value of node i where it is a numeric constant (or the float conversion of one), else None."""
    node = nodes[i]
    if node.op == "cast" and node.args[1] == F32:
        node = nodes[node.args[0]]
    if node.op != "const" or node.type == BOOL:
        return None
    return float.fromhex(node.args[0]) if node.type == F32 else float(node.args[0])


def input_deps(graph: ModGraph) -> List[frozenset]:
    """Per node, the inputs ("score", "b", "h", "q_idx", "kv_idx") its value depends on."""
    deps: List[frozenset] = []
    for node in graph.nodes:
        if node.op == "input":
            deps.append(frozenset((node.args[0],)))
        elif node.op == "const":
            deps.append(frozenset())
        else:
            ids = node.args[1:] if node.op == "load" else node.args[:-1] if node.op == "cast" else node.args
            deps.append(frozenset().union(*(deps[i] for i in ids)))
    return deps


def emit(graph: ModGraph, inputs: Dict[str, object], aux: Sequence[cute.Tensor] = (), shared=None):
    """The graph's result as a DSL value (Float32 for a score_mod, Boolean for a mask_mod). inputs: "score" (a
    score_mod's), "b", "h", "q_idx", "kv_idx" (those the graph uses). Call it inside @cute.jit / @cute.kernel code.

    shared: (cache dict, {input name: key}) to compute a subexpression once for every element that shares its
    inputs' keys (a tile's kernel passes the row for q_idx and the column for kv_idx, b and h being the tile's
    constants): a table read indexed by q_idx alone is then loaded once per row, not once per score. The values
    stay in one traced region (one tile), so reuse is plain SSA."""
    if len(aux) != len(graph.aux_types):
        raise ValueError(f"the graph reads {len(graph.aux_types)} captured tensors, {len(aux)} given")
    cache, keys = shared if shared is not None else (None, None)
    deps = input_deps(graph)
    vals: List = []
    for i, node in enumerate(graph.nodes):
        key = None
        if cache is not None and "score" not in deps[i]:
            key = (id(graph), i) + tuple(keys.get(name) for name in sorted(deps[i]))
            if key in cache:
                vals.append(cache[key])
                continue
        value = _emit_node(node, vals, inputs, aux, graph.nodes, "score" in deps[i])
        if key is not None:
            cache[key] = value
        vals.append(value)
    return vals[-1]
