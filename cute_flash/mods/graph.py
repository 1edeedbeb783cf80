"""score_mod / mask_mod callables as small expression graphs: what a callable may contain, how it is traced, and how
a graph is evaluated with torch (the float64 reference, block masks) and differentiated (the backward's dS).

A callable is written as FlexAttention writes it, on scalars:

    def alibi(score, b, h, q_idx, kv_idx):            # score_mod: the scaled score -> a new score
        return score - slopes[h] * (q_idx - kv_idx)
    def sliding(b, h, q_idx, kv_idx):                 # mask_mod: True where the key is visible
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 256)

`trace_score_mod` / `trace_mask_mod` call it once on symbolic stand-ins and record every operation into a `ModGraph`:
a tuple of nodes in evaluation order, whose last node is the result. Inputs: `score` (float32) and the indices
`b`, `h`, `q_idx`, `kv_idx` (int32; q_idx / kv_idx are positions within the sequence, `h` the query head).

What a callable may contain (anything else raises `ModError` naming it):
  - arithmetic and comparisons on the inputs, Python numbers and bools: + - * / // % **, unary -, abs(), < <= > >=
    == !=, and & | ~ ^ on booleans;
  - the torch functions of `_UNARY` / `_BINARY` below (torch.exp, torch.tanh, torch.where, torch.maximum, ...), as
    functions or as tensor methods, and `.to(torch.float32 / torch.int32 / torch.bool)` / `.float()` / `.int()`;
  - reads of captured tensors by index: `bias[h, q_idx - kv_idx + max_len]`, one integer index expression per
    dimension, each in [0, size) (kernels neither wrap negative indices, as torch does, nor check bounds)
    (a tensor of any dtype, read as float32, int32 or bool; its values are runtime data, its dtype and number of
    dimensions part of the graph).
No Python control flow on the inputs (`if q_idx > 3:` raises: use torch.where), no randomness, no in-place ops.

The graph, not the function object, is what a kernel is compiled for: two callables that trace to the same graph
share kernels (`ModGraph.key`); a captured tensor's values change no kernel, only its dtype and rank do.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

F32, I32, BOOL = "f32", "i32", "bool"
SCORE_INPUTS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_INPUTS = ("b", "h", "q_idx", "kv_idx")
_INPUT_TYPES = {"score": F32, "b": I32, "h": I32, "q_idx": I32, "kv_idx": I32}
MAX_TABLES = 4  # captured tensors a kernel takes per call (score_mod's and mask_mod's together)


class ModError(TypeError):
    """A score_mod / mask_mod uses something cute-flash cannot compile; the message names it."""


@dataclass(frozen=True)
class Node:
    """op: "input" (args: (name,)), "const" (args: (value,), a float as its float.hex text), "load" (args: (aux
    index, index node ids...)) or an
    operation of _UNARY / _BINARY / "where" / "cast" (args: node ids, and for "cast" the target type last)."""

    op: str
    args: tuple
    type: str


# Elementwise operations a graph may hold: name -> result type rule. Unary float functions promote ints to float32.
_UNARY = {
    "neg": "same", "abs": "same", "exp": F32, "exp2": F32, "log": F32, "log2": F32, "sqrt": F32, "rsqrt": F32,
    "tanh": F32, "sigmoid": F32, "sin": F32, "cos": F32, "floor": "same", "ceil": "same", "not": BOOL,
}  # fmt: skip
_BINARY = {
    "add": "num", "sub": "num", "mul": "num", "truediv": F32, "floordiv": "num", "mod": "num", "pow": F32,
    "maximum": "num", "minimum": "num", "lt": BOOL, "le": BOOL, "gt": BOOL, "ge": BOOL, "eq": BOOL, "ne": BOOL,
    "and": BOOL, "or": BOOL, "xor": BOOL,
}  # fmt: skip
_TORCH_UNARY = {
    torch.neg: "neg", torch.abs: "abs", torch.exp: "exp", torch.exp2: "exp2", torch.log: "log", torch.log2: "log2",
    torch.sqrt: "sqrt", torch.rsqrt: "rsqrt", torch.tanh: "tanh", torch.sigmoid: "sigmoid", torch.sin: "sin",
    torch.cos: "cos", torch.floor: "floor", torch.ceil: "ceil", torch.logical_not: "not",
    torch.Tensor.neg: "neg", torch.Tensor.abs: "abs", torch.Tensor.exp: "exp", torch.Tensor.exp2: "exp2",
    torch.Tensor.log: "log", torch.Tensor.log2: "log2", torch.Tensor.sqrt: "sqrt", torch.Tensor.rsqrt: "rsqrt",
    torch.Tensor.tanh: "tanh", torch.Tensor.sigmoid: "sigmoid", torch.Tensor.sin: "sin", torch.Tensor.cos: "cos",
    torch.Tensor.floor: "floor", torch.Tensor.ceil: "ceil", torch.Tensor.logical_not: "not",
    torch.Tensor.__neg__: "neg", torch.Tensor.__abs__: "abs", torch.Tensor.__invert__: "not",
}  # fmt: skip
_TORCH_BINARY = {
    torch.add: "add", torch.sub: "sub", torch.mul: "mul", torch.div: "truediv", torch.true_divide: "truediv",
    torch.floor_divide: "floordiv", torch.remainder: "mod", torch.pow: "pow", torch.maximum: "maximum",
    torch.minimum: "minimum", torch.lt: "lt", torch.le: "le", torch.gt: "gt", torch.ge: "ge", torch.eq: "eq",
    torch.ne: "ne", torch.logical_and: "and", torch.logical_or: "or", torch.logical_xor: "xor",
    torch.Tensor.__add__: "add", torch.Tensor.__radd__: "add", torch.Tensor.__sub__: "sub",
    torch.Tensor.__mul__: "mul", torch.Tensor.__rmul__: "mul", torch.Tensor.__truediv__: "truediv",
    torch.Tensor.__floordiv__: "floordiv", torch.Tensor.__mod__: "mod", torch.Tensor.__pow__: "pow",
    torch.Tensor.__lt__: "lt", torch.Tensor.__le__: "le", torch.Tensor.__gt__: "gt", torch.Tensor.__ge__: "ge",
    torch.Tensor.__eq__: "eq", torch.Tensor.__ne__: "ne", torch.Tensor.__and__: "and", torch.Tensor.__or__: "or",
    torch.Tensor.__xor__: "xor", torch.Tensor.add: "add", torch.Tensor.sub: "sub", torch.Tensor.mul: "mul",
    torch.Tensor.div: "truediv", torch.Tensor.maximum: "maximum", torch.Tensor.minimum: "minimum",
    torch.Tensor.pow: "pow", torch.Tensor.remainder: "mod",
}  # fmt: skip
_DTYPES = {torch.float32: F32, torch.float: F32, torch.int32: I32, torch.int: I32, torch.bool: BOOL}


@dataclass(frozen=True)
class ModGraph:
    """A traced callable. kind: "score" or "mask"; nodes in evaluation order, the last one the result; aux: the
    captured tensors (runtime data, in first-read order), aux_types their (dtype, ndim) as read."""

    kind: str
    nodes: Tuple[Node, ...]
    aux: Tuple[torch.Tensor, ...]
    aux_types: Tuple[Tuple[str, int], ...]

    @property
    def key(self) -> tuple:
        """What generated code depends on: the operations and the captured tensors' types, not their values."""
        return (self.kind, self.nodes, self.aux_types)

    @property
    def result(self) -> int:
        return len(self.nodes) - 1

    def uses(self, name: str) -> bool:
        return any(n.op == "input" and n.args[0] == name for n in self.nodes)


class _Tracer:
    def __init__(self):
        self.nodes: List[Node] = []
        self.memo: Dict[Node, int] = {}
        self.aux: List[torch.Tensor] = []
        self.aux_types: List[Tuple[str, int]] = []

    def add(self, op: str, args: tuple, type_: str) -> "Sym":
        node = Node(op, args, type_)
        i = self.memo.get(node)
        if i is None:
            i = self.memo[node] = len(self.nodes)
            self.nodes.append(node)
        return Sym(self, i)

    def const(self, value) -> "Sym":
        if isinstance(value, bool):
            return self.add("const", (bool(value),), BOOL)
        if isinstance(value, numbers.Integral):
            if not -(2**31) <= int(value) < 2**31:
                raise ModError(f"the integer constant {value} does not fit int32")
            return self.add("const", (int(value),), I32)
        if isinstance(value, numbers.Real):
            # As its exact hex text: 0.0 and -0.0 (equal as floats) are different constants, and keys.
            return self.add("const", (float(value).hex(),), F32)
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            return self.load(value, ())  # a captured scalar tensor: runtime data, like any captured tensor
        raise ModError(
            f"a value of type {type(value).__name__} ({value!r:.60}) cannot be used in a score_mod / mask_mod"
        )

    def lift(self, x) -> "Sym":
        if isinstance(x, Sym):
            if x.tracer is not self:
                raise ModError("a symbol of another trace was captured")
            return x
        return self.const(x)

    def type_of(self, x: "Sym") -> str:
        return self.nodes[x.index].type

    def cast(self, x: "Sym", to: str) -> "Sym":
        if self.type_of(x) == to:
            return x
        return self.add("cast", (x.index, to), to)

    def unary(self, op: str, x) -> "Sym":
        x = self.lift(x)
        rule = _UNARY[op]
        t = self.type_of(x)
        if op == "not":
            if t != BOOL:
                raise ModError("~ / logical_not needs a boolean (a comparison's result)")
        elif t == BOOL:
            raise ModError(f"{op} of a boolean: cast it first (.float() / .int())")
        if rule == F32 and t != F32:
            x, t = self.cast(x, F32), F32
        return self.add(op, (x.index,), t if rule == "same" else rule)

    def binary(self, op: str, a, b) -> "Sym":
        a, b = self.lift(a), self.lift(b)
        ta, tb = self.type_of(a), self.type_of(b)
        rule = _BINARY[op]
        if op in ("and", "or", "xor"):
            if ta != BOOL or tb != BOOL:
                raise ModError(f"{op} needs booleans on both sides (comparisons' results); got {ta} and {tb}")
            return self.add(op, (a.index, b.index), BOOL)
        if BOOL in (ta, tb):
            if op in ("eq", "ne") and ta == tb:
                return self.add(op, (a.index, b.index), BOOL)
            raise ModError(f"{op} of a boolean: cast it first (.float() / .int())")
        t = F32 if F32 in (ta, tb) or rule == F32 else I32
        a, b = self.cast(a, t), self.cast(b, t)
        if op in ("floordiv", "mod") and t == F32:
            raise ModError(f"{op} of floating-point values is not supported (only of indices)")
        divisor = self.nodes[b.index]
        if op in ("floordiv", "mod") and divisor.op == "const" and divisor.args[0] == 0:
            raise ModError(f"{op} by the constant 0 (integer division by zero)")
        return self.add(op, (a.index, b.index), t if rule == "num" else rule)

    def where(self, cond, a, b) -> "Sym":
        cond, a, b = self.lift(cond), self.lift(a), self.lift(b)
        if self.type_of(cond) != BOOL:
            raise ModError("torch.where needs a boolean condition")
        ta, tb = self.type_of(a), self.type_of(b)
        if BOOL in (ta, tb) and ta != tb:
            raise ModError("torch.where of a boolean and a number: cast the boolean first")
        t = BOOL if ta == BOOL else (F32 if F32 in (ta, tb) else I32)
        return self.add("where", (cond.index, self.cast(a, t).index, self.cast(b, t).index), t)

    def load(self, tensor: torch.Tensor, index) -> "Sym":
        if not isinstance(index, tuple):
            index = (index,)
        if any(i is Ellipsis or i is None or isinstance(i, slice) for i in index):
            raise ModError("a captured tensor is read with one integer index per dimension (no slices, None or ...)")
        if len(index) != tensor.dim():
            raise ModError(
                f"a captured tensor of {tensor.dim()} dimensions is read with {len(index)} indices: give one per "
                "dimension"
            )
        wrapped = []
        for dim, i in enumerate(index):  # a constant index wraps as torch's does; the kernels' reads never wrap
            if isinstance(i, int) and not isinstance(i, bool):
                if not -tensor.shape[dim] <= i < tensor.shape[dim]:
                    raise ModError(f"index {i} is out of range for dimension {dim} of size {tensor.shape[dim]}")
                i = i % tensor.shape[dim]
            wrapped.append(i)
        idx = [self.lift(i) for i in wrapped]
        for i in idx:
            if self.type_of(i) != I32:
                raise ModError("a captured tensor's index must be an integer expression of b, h, q_idx, kv_idx")
        if tensor.is_floating_point():
            t = F32
        elif tensor.dtype == torch.bool:
            t = BOOL
        elif tensor.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
            t = I32
        else:
            raise ModError(f"a captured tensor of dtype {tensor.dtype} cannot be read")
        for j, a in enumerate(self.aux):
            if a is tensor:
                slot = j
                break
        else:
            slot = len(self.aux)
            self.aux.append(tensor)
            self.aux_types.append((t, tensor.dim()))
        return self.add("load", (slot, *(i.index for i in idx)), t)


_NO_METHODS = ("item", "tolist", "numpy", "cpu", "cuda", "backward", "__setitem__")


class Sym:
    """A traced value (a node of the graph under construction)."""

    __slots__ = ("tracer", "index")

    def __init__(self, tracer: _Tracer, index: int):
        self.tracer = tracer
        self.index = index

    def __repr__(self):
        node = self.tracer.nodes[self.index]
        return f"Sym({node.op}, {node.type})"

    def __bool__(self):
        raise ModError(
            "Python control flow on a traced value (if / and / or / not / a comparison chain): use torch.where, "
            "& | ~ instead"
        )

    def __index__(self):
        raise ModError(
            "a traced value used as a Python int (a slice bound, range(), a shape): read captured tensors with one "
            "integer expression per dimension, tensor[b, h, ...]"
        )

    __int__ = __float__ = __index__

    def __getitem__(self, _):
        raise ModError("the inputs are scalars: they cannot be indexed")

    def _b(op, swap=False):
        if swap:
            return lambda self, other: self.tracer.binary(op, other, self)
        return lambda self, other: self.tracer.binary(op, self, other)

    __add__, __radd__ = _b("add"), _b("add", True)
    __sub__, __rsub__ = _b("sub"), _b("sub", True)
    __mul__, __rmul__ = _b("mul"), _b("mul", True)
    __truediv__, __rtruediv__ = _b("truediv"), _b("truediv", True)
    __floordiv__, __rfloordiv__ = _b("floordiv"), _b("floordiv", True)
    __mod__, __rmod__ = _b("mod"), _b("mod", True)
    __pow__, __rpow__ = _b("pow"), _b("pow", True)
    __lt__, __le__, __gt__, __ge__ = _b("lt"), _b("le"), _b("gt"), _b("ge")
    __eq__, __ne__ = _b("eq"), _b("ne")
    __and__, __rand__ = _b("and"), _b("and", True)
    __or__, __ror__ = _b("or"), _b("or", True)
    __xor__, __rxor__ = _b("xor"), _b("xor", True)
    del _b
    __hash__ = None

    def __neg__(self):
        return self.tracer.unary("neg", self)

    def __abs__(self):
        return self.tracer.unary("abs", self)

    def __invert__(self):
        return self.tracer.unary("not", self)

    def __pos__(self):
        return self

    def float(self):
        return self.tracer.cast(self, F32)

    def int(self):
        return self.tracer.cast(self, I32)

    def bool(self):
        if self.tracer.type_of(self) != BOOL:
            return self.tracer.binary("ne", self, 0)
        return self

    def to(self, dtype, *a, **kw):
        if dtype not in _DTYPES or a or kw:
            raise ModError(f".to({dtype}) in a score_mod / mask_mod: only float32, int32 and bool casts")
        return self.bool() if _DTYPES[dtype] == BOOL else self.tracer.cast(self, _DTYPES[dtype])

    def __getattr__(self, name):
        fn = getattr(torch.Tensor, name, None)
        if fn in _TORCH_UNARY:
            return lambda: self.tracer.unary(_TORCH_UNARY[fn], self)
        if fn in _TORCH_BINARY:
            return lambda other: self.tracer.binary(_TORCH_BINARY[fn], self, other)
        if name == "clamp":
            return lambda min=None, max=None: _clamp(self.tracer, self, min, max)
        raise ModError(f"tensor method .{name}() is not supported in a score_mod / mask_mod")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracer = next(a.tracer for a in _flatten(args) if isinstance(a, Sym))
        if func in (torch.Tensor.__getitem__,) and isinstance(args[0], torch.Tensor):
            return tracer.load(args[0], args[1])
        if kwargs and func is not torch.clamp:
            raise ModError(f"{_name(func)} with keyword arguments is not supported in a score_mod / mask_mod")
        if func in _TORCH_UNARY and len(args) == 1:
            return tracer.unary(_TORCH_UNARY[func], args[0])
        if func in _TORCH_BINARY and len(args) == 2:
            return tracer.binary(_TORCH_BINARY[func], args[0], args[1])
        if func is torch.where and len(args) == 3:
            return tracer.where(*args)
        if func in (torch.clamp, torch.Tensor.clamp):
            lo = kwargs.get("min", args[1] if len(args) > 1 else None)
            hi = kwargs.get("max", args[2] if len(args) > 2 else None)
            return _clamp(tracer, args[0], lo, hi)
        raise ModError(f"{_name(func)} is not supported in a score_mod / mask_mod (graph.py lists what is)")


def _clamp(tracer: _Tracer, x, lo, hi) -> Sym:
    if lo is not None:
        x = tracer.binary("maximum", x, lo)
    if hi is not None:
        x = tracer.binary("minimum", x, hi)
    return tracer.lift(x)


def _flatten(args):
    for a in args:
        if isinstance(a, (tuple, list)):
            yield from _flatten(a)
        else:
            yield a


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _trace(fn: Callable, kind: str, inputs: Sequence[str]) -> ModGraph:
    if not callable(fn):
        raise TypeError(f"{kind}_mod must be callable, got {type(fn).__name__}")
    tracer = _Tracer()
    syms = [tracer.add("input", (name,), _INPUT_TYPES[name]) for name in inputs]
    try:
        out = fn(*syms)
    except ModError:
        raise
    except (TypeError, RuntimeError, AttributeError, IndexError) as e:
        raise ModError(f"tracing the {kind}_mod failed: {type(e).__name__}: {e}") from e
    out = tracer.lift(out)
    want = F32 if kind == "score" else BOOL
    if tracer.type_of(out) != want:
        if kind == "mask":
            raise ModError(f"a mask_mod must return a boolean (a comparison), got {tracer.type_of(out)}")
        out = tracer.cast(out, F32)
    return _prune(tracer, out, kind)


def _operands(node: Node) -> tuple:
    if node.op in ("input", "const"):
        return ()
    if node.op == "load":
        return node.args[1:]
    if node.op == "cast":
        return node.args[:1]
    return node.args


def _renumber(node: Node, remap: dict) -> Node:
    if node.op in ("input", "const"):
        return node
    if node.op == "load":
        return Node("load", (node.args[0], *(remap[i] for i in node.args[1:])), node.type)
    if node.op == "cast":
        return Node("cast", (remap[node.args[0]], node.args[1]), node.type)
    return Node(node.op, tuple(remap[i] for i in node.args), node.type)


def trace_score_mod(fn: Callable) -> ModGraph:
    """The graph of `score_mod(score, b, h, q_idx, kv_idx) -> score`."""
    return _trace(fn, "score", SCORE_INPUTS)


def trace_mask_mod(fn: Callable) -> ModGraph:
    """The graph of `mask_mod(b, h, q_idx, kv_idx) -> bool`."""
    return _trace(fn, "mask", MASK_INPUTS)


# --- evaluation with torch ---------------------------------------------------------------------------------------
_TORCH_OPS = {
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log2": torch.log2,
    "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "sin": torch.sin,
    "cos": torch.cos, "floor": torch.floor, "ceil": torch.ceil, "not": torch.logical_not, "add": torch.add,
    "sub": torch.sub, "mul": torch.mul, "truediv": torch.true_divide, "floordiv": torch.floor_divide,
    "mod": torch.remainder, "pow": torch.pow, "maximum": torch.maximum, "minimum": torch.minimum, "lt": torch.lt,
    "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne, "and": torch.logical_and,
    "or": torch.logical_or, "xor": torch.logical_xor,
}  # fmt: skip


def evaluate(graph: ModGraph, inputs: Dict[str, torch.Tensor], float_dtype=torch.float64) -> torch.Tensor:
    """The graph's result on broadcastable tensors (`inputs`: name -> tensor, integer indices, `score` floating):
    floating values in `float_dtype` (the reference's float64; the kernels compute in float32), integers in int64
    (int32 arithmetic of in-range indices gives the same values), reads of the captured tensors by the index
    tensors (out-of-range indices raise IndexError, as a kernel's reads would be undefined)."""
    vals: List[torch.Tensor] = []
    types = {F32: float_dtype, I32: torch.int64, BOOL: torch.bool}
    for node in graph.nodes:
        if node.op == "input":
            v = inputs[node.args[0]]
            v = v.to(types[node.type])
        elif node.op == "const":
            value = float.fromhex(node.args[0]) if node.type == F32 else node.args[0]
            v = torch.tensor(value, dtype=types[node.type])
        elif node.op == "load":
            aux = graph.aux[node.args[0]]
            idx = [vals[i] for i in node.args[1:]]
            shape = torch.broadcast_shapes(*(i.shape for i in idx))
            idx = [i.to(aux.device).expand(shape) for i in idx]
            for i, n in zip(idx, aux.shape):
                if i.numel() and (int(i.min()) < 0 or int(i.max()) >= n):
                    raise IndexError(
                        f"a captured tensor of shape {tuple(aux.shape)} is read at an index outside [0, size): "
                        "kernels neither wrap negative indices (as torch does) nor check bounds"
                    )
            v = aux[tuple(idx)].to(types[node.type])
        elif node.op == "cast":
            v = vals[node.args[0]].to(types[node.type])
        elif node.op == "where":
            c, a, b = (vals[i] for i in node.args)
            v = torch.where(c, a, b)
        elif node.op == "truediv":
            a, b = (vals[i].to(float_dtype) for i in node.args)
            v = a / b
        elif node.op == "pow":
            a, b = (vals[i].to(float_dtype) for i in node.args)
            v = torch.pow(a, b)
        else:
            v = _TORCH_OPS[node.op](*(vals[i] for i in node.args))
            if node.type == I32 and node.op in _WRAPPING:  # 32-bit integers, as the kernels': wraps past 2^31
                v = torch.remainder(v + 2**31, 2**32) - 2**31
        vals.append(v)
    return vals[-1]


_WRAPPING = frozenset(("add", "sub", "mul", "neg", "abs"))


def constant_result(graph: ModGraph) -> Optional[float]:
    """The graph's value where it reads no input and no captured tensor (a score_mod's derivative 1 for an added
    bias), else None."""
    if any(n.op in ("input", "load") for n in graph.nodes):
        return None
    return float(evaluate(graph, {}))


# --- the derivative of a score_mod in its score ----------------------------------------------------------------
def score_derivative(graph: ModGraph) -> ModGraph:
    """A graph computing d score_mod / d score at the same inputs (forward-mode differentiation of the nodes): the
    backward's dS is dS_mod * this. Raises ModError where the derivative is not defined by these rules (a score
    that reaches a captured tensor's index, floor / ceil / mod / floordiv of the score)."""
    if graph.kind != "score":
        raise ValueError("only a score_mod has a derivative")
    tracer = _Tracer()
    tracer.aux, tracer.aux_types = list(graph.aux), list(graph.aux_types)
    val: List[Sym] = []
    der: List[Optional[Sym]] = []  # None: the node does not depend on the score (derivative 0)
    for node in graph.nodes:
        a = node.args
        if node.op == "input":
            v, d = tracer.add("input", a, node.type), (tracer.const(1.0) if a[0] == "score" else None)
        elif node.op == "const":
            v, d = tracer.add("const", a, node.type), None
        elif node.op == "load":
            if any(der[i] is not None for i in a[1:]):
                raise ModError("a captured tensor indexed by an expression of the score has no derivative")
            v, d = tracer.add("load", (a[0], *(val[i].index for i in a[1:])), node.type), None
        elif node.op == "cast":
            v = tracer.cast(val[a[0]], a[1])
            d = der[a[0]] if a[1] == F32 else None
            if d is not None and tracer.type_of(val[a[0]]) != F32:
                d = None
        else:
            xs = [val[i] for i in a]
            ds = [der[i] for i in a]
            v = _apply(tracer, node.op, xs)
            d = None if all(x is None for x in ds) else _chain(tracer, node.op, xs, ds, v)
        val.append(v)
        der.append(d)
    out = der[-1] if der[-1] is not None else tracer.const(0.0)
    # The score_mod's tables in its slots: a kernel passes one list of tables to both graphs.
    return _prune(tracer, tracer.cast(tracer.lift(out), F32), "score", keep_tables=True)


def _apply(tracer: _Tracer, op: str, xs: List[Sym]) -> Sym:
    if op == "where":
        return tracer.where(*xs)
    if op in _UNARY:
        return tracer.unary(op, xs[0])
    return tracer.binary(op, xs[0], xs[1])


def _chain(tracer: _Tracer, op: str, xs: List[Sym], ds: List[Optional[Sym]], v: Sym) -> Optional[Sym]:
    zero = tracer.const(0.0)
    d = [zero if x is None else x for x in ds]
    t = tracer
    if op in ("lt", "le", "gt", "ge", "eq", "ne", "and", "or", "xor", "not"):
        return None  # booleans carry no derivative
    if op == "where":
        return t.where(xs[0], d[1], d[2])
    x = xs[0]
    if op == "neg":
        return t.unary("neg", d[0])
    if op == "abs":
        return t.where(t.binary("lt", x, 0), t.unary("neg", d[0]), d[0])
    if op == "exp":
        return t.binary("mul", v, d[0])
    if op == "exp2":
        return t.binary("mul", t.binary("mul", v, math.log(2.0)), d[0])
    if op == "log":
        return t.binary("truediv", d[0], x)
    if op == "log2":
        return t.binary("truediv", d[0], t.binary("mul", x, math.log(2.0)))
    if op == "sqrt":
        return t.binary("truediv", d[0], t.binary("mul", v, 2.0))
    if op == "rsqrt":  # -1/2 x^-3/2 = -v^3 / 2
        return t.binary("mul", t.binary("mul", t.binary("mul", v, t.binary("mul", v, v)), -0.5), d[0])
    if op == "tanh":
        return t.binary("mul", t.binary("sub", 1.0, t.binary("mul", v, v)), d[0])
    if op == "sigmoid":
        return t.binary("mul", t.binary("mul", v, t.binary("sub", 1.0, v)), d[0])
    if op == "sin":
        return t.binary("mul", t.unary("cos", x), d[0])
    if op == "cos":
        return t.binary("mul", t.unary("neg", t.unary("sin", x)), d[0])
    # (An operand that does not depend on the score adds no term, as in autograd: no 0 * x, NaN for an infinite x.)
    if op in ("add", "sub"):
        if ds[1] is None:
            return d[0]
        if ds[0] is None:
            return d[1] if op == "add" else t.unary("neg", d[1])
        return t.binary(op, d[0], d[1])
    if op in ("floor", "ceil"):
        return None  # piecewise constant: derivative 0 (as autograd's)
    y = xs[1]
    if op == "mul":
        if ds[1] is None:
            return t.binary("mul", d[0], y)
        if ds[0] is None:
            return t.binary("mul", x, d[1])
        return t.binary("add", t.binary("mul", d[0], y), t.binary("mul", x, d[1]))
    if op == "truediv" and ds[1] is None:
        return t.binary("truediv", d[0], y)
    if op == "truediv" and ds[0] is None:  # -x dy / y^2
        return t.binary("truediv", t.unary("neg", t.binary("mul", x, d[1])), t.binary("mul", y, y))
    if op == "truediv":  # (dx y - x dy) / y^2
        num = t.binary("sub", t.binary("mul", d[0], y), t.binary("mul", x, d[1]))
        return t.binary("truediv", num, t.binary("mul", y, y))
    if op == "pow":  # d(x^y) = y x^(y-1) dx + x^y log(x) dy
        terms = []
        if ds[0] is not None:
            terms.append(t.binary("mul", t.binary("mul", y, t.binary("pow", x, t.binary("sub", y, 1.0))), d[0]))
        if ds[1] is not None:
            terms.append(t.binary("mul", t.binary("mul", v, t.unary("log", x)), d[1]))
        return terms[0] if len(terms) == 1 else t.binary("add", terms[0], terms[1])
    if op in ("maximum", "minimum"):
        pick_x = t.binary("ge" if op == "maximum" else "le", x, y)
        return t.where(pick_x, d[0], d[1])
    raise ModError(f"{op} of the score has no derivative here")


def _prune(tracer: _Tracer, out: Sym, kind: str, keep_tables: bool = False) -> ModGraph:
    """The nodes `out` depends on, in order and renumbered (a callable may compute values it drops), and the captured
    tensors they read, renumbered in first-read order (keep_tables: all of the tracer's, in its slots)."""
    live = {out.index}
    for i in range(out.index, -1, -1):
        if i in live:
            live.update(_operands(tracer.nodes[i]))
    order = sorted(live)
    remap = {old: new for new, old in enumerate(order)}
    nodes = tuple(_renumber(tracer.nodes[i], remap) for i in order)
    if keep_tables:
        return ModGraph(kind, nodes, tuple(tracer.aux), tuple(tracer.aux_types))
    used = list(dict.fromkeys(n.args[0] for n in nodes if n.op == "load"))
    slot = {old: new for new, old in enumerate(used)}
    nodes = tuple(Node("load", (slot[n.args[0]], *n.args[1:]), n.type) if n.op == "load" else n for n in nodes)
    return ModGraph(kind, nodes, tuple(tracer.aux[i] for i in used), tuple(tracer.aux_types[i] for i in used))
