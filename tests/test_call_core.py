"""The call core's structure (cute_flash/core/), without a GPU: no module of cute_flash imports another's private
names, the import graph has no loops (lazy imports inside functions count), and the entry points, the custom ops and
the C++ call path all take the call's fields from the one list (core/fields.py)."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest
import torch

import cute_flash
from cute_flash.core import call, fields, plan

ROOT = pathlib.Path(cute_flash.__file__).resolve().parent

# Private imports in files the kernel helpers own (arch/sm*, common/) and the FP8 helpers, waiting for their owners
# (each: a public name in the module imported from, or the helper moved to the importer). Listed so that no new ones
# appear; an entry that no longer occurs fails the test until it is removed here.
KNOWN_PRIVATE_IMPORTS: set = set()


def _modules():
    """{module name: (path relative to cute_flash/, parsed tree)} of every module of the package."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = (str(path.relative_to(ROOT)), ast.parse(path.read_text()), path.name == "__init__.py")
    return out


MODULES = _modules()


def _target(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str):
    """(imported module, name or None) of every import in `module`, module level and inside functions alike."""
    _, tree, is_package = MODULES[module]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _target(module, is_package, node)
            for alias in node.names:
                yield target, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_imports():
    found = set()
    for module, (rel, tree, _) in MODULES.items():
        aliases = {}  # local name -> cute_flash module it stands for
        for target, name in _imports(module):
            if not target.startswith("cute_flash"):
                continue
            full = target if name is None else f"{target}.{name}"
            if full in MODULES:
                aliases[name or target.split(".")[0]] = full if name else target.split(".")[0]
            elif name is not None and _private(name):
                found.add((rel, full))
        for node in ast.walk(tree):  # module._name of an imported cute_flash module
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                if _private(node.attr):
                    found.add((rel, f"{aliases[node.value.id]}.{node.attr}"))
    return found


def test_no_module_imports_another_modules_private_names():
    found = _private_imports()
    assert found - KNOWN_PRIVATE_IMPORTS == set(), "new private imports across modules"
    assert KNOWN_PRIVATE_IMPORTS - found == set(), "fixed: remove these from KNOWN_PRIVATE_IMPORTS"
    owned = {rel for rel, _ in KNOWN_PRIVATE_IMPORTS}
    assert all(rel.startswith(("arch/sm", "fp8/")) for rel in owned)  # none in the host path


def _import_graph():
    graph = {m: set() for m in MODULES}
    for module in MODULES:
        for target, name in _imports(module):
            full = target if name is None else f"{target}.{name}"
            if full in MODULES:
                graph[module].add(full)
            elif target in MODULES and not (name and name.startswith("__")):
                # `from pkg import x` of a name defined in pkg/__init__.py; dunder metadata (`from . import
                # __version__`, set before __init__ imports anything) is not an import of the package's modules
                graph[module].add(target)
        graph[module].discard(module)
    return graph


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_loops():
    assert _cycles(_import_graph()) == []


def test_the_cycle_finder_finds_a_loop():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# --- one list of fields -------------------------------------------------------------------------------------------
def test_fields_are_scalars_then_tensors():
    kinds = [f.kind for f in fields.CALL]
    assert kinds == sorted(kinds, key=lambda k: k != fields.SCALAR) and fields.NUM_SCALARS == kinds.count("scalar")
    assert fields.NUM_SCALARS == 6


def test_the_entry_points_take_the_fields_in_their_order():
    """call.dense / call.packed take the fields in core/fields.py's order (window_size standing for its two bounds)
    and build the scalar tuple in that order; the public functions have every field as a keyword."""
    names = [f.name for f in fields.CALL]
    names = names[:2] + ["window_size"] + names[4:]
    dense = list(inspect.signature(call.dense).parameters)
    assert dense[3 : 3 + len(names)] == names
    packed = list(inspect.signature(call.packed).parameters)
    assert packed[4 : 4 + len(names)] == names
    for fn in (cute_flash.attention, cute_flash.explain, cute_flash.attention_varlen, cute_flash.explain_varlen):
        assert set(names) <= set(inspect.signature(fn).parameters), fn.__name__
    from cute_flash.distributed import ring_attention

    assert {"softcap", "learnable_sink"} <= set(inspect.signature(ring_attention).parameters)


def test_keywords_and_keys_round_trip():
    scalars, tensors = fields.from_keywords(
        causal=True, softmax_scale=0.5, window_size=(3, -1), deterministic=False, softcap=2.0, learnable_sink=None
    )
    assert scalars == (True, 0.5, 3, -1, False, 2.0) and tensors == (None,)
    kw = fields.keywords(scalars, [3, -1], tensors)
    assert kw == dict(
        causal=True, softmax_scale=0.5, window_size=[3, -1], deterministic=False, softcap=2.0, learnable_sink=None
    )
    with pytest.raises(TypeError, match="a call's fields"):
        fields.from_keywords(causal=True, window_size=(None, None))
    op_args = scalars + tensors + (None, None, None, 0, 0)
    assert fields.from_op(op_args) == (scalars, (3, -1), tensors, (None, None, None, 0, 0))


def test_the_cpp_library_is_built_for_the_fields():
    from cute_flash import native

    assert native._defines() == [f"-DCUTE_FLASH_KEY_SCALARS={fields.NUM_SCALARS}"]


# --- the plan of a call: empty problems, decoding that sees no key ------------------------------------------------
def test_a_call_without_keys_launches_nothing(monkeypatch):
    from cute_flash import validation
    from cute_flash.core import device, launch

    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(device, "capability", lambda t: (9, 0))
    q = torch.randn(2, 5, 4, 64, dtype=torch.bfloat16)
    k = v = torch.randn(2, 0, 2, 64, dtype=torch.bfloat16)
    sink = torch.randn(4, requires_grad=True)
    p = plan.dense(q, k, v, (False, None, None, None, False, 0.0), (None, None), (sink,))
    assert p.empty
    out, lse = launch.forward(p, q, k, v, sink)
    assert torch.all(out == 0) and torch.equal(lse, sink.detach().view(1, 4, 1).expand(2, 4, 5))
    dlse = torch.randn_like(lse)
    dq, dk, dv, dsink = launch.backward(p, torch.ones_like(out), q, k, v, out, lse, dlse, sink)
    assert torch.all(dq == 0) and dk.shape == k.shape
    # out 0: D = 0, P_sink = 1, so dsink_h = sum over batch and rows of dlse
    torch.testing.assert_close(dsink, dlse.sum(dim=(0, 2)))


def test_the_cpp_path_takes_the_scalar_fields_by_name_and_python_types_only(monkeypatch):
    """native_path.forward has one parameter per scalar field, in their order; a numpy scalar (which TVM-FFI would
    merge with Python's own) in any of them keeps the call off the C++ path."""
    import numpy as np

    from cute_flash.core import native_path

    names = [f.name for f in fields.CALL if f.kind == fields.SCALAR]
    assert list(inspect.signature(native_path.forward).parameters)[3:] == names
    monkeypatch.setattr(native_path, "_forward", lambda *a: True)  # a library that would serve anything
    q = torch.empty(1, 4, 2, 64, dtype=torch.bfloat16)
    plain = (True, 0.5, 3, None, False, 0.0)
    numpy = (np.bool_(True), np.float64(0.5), np.int64(3), np.int64(0), np.bool_(False), np.float32(0.0))
    for i in range(len(names)):
        scalars = plain[:i] + (numpy[i],) + plain[i + 1 :]
        assert native_path.forward(q, q, q, *scalars) is False, names[i]
