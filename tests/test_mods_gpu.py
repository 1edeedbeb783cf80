"""The generated code of score_mod / mask_mod graphs on a GPU: the probe kernel (cute_flash/mods/probe.py) of every
example of tests/test_mods.py against graph.evaluate on random inputs: masks exactly, scores within float32
rounding of the fast math functions."""

from __future__ import annotations

import pytest
import torch

from cute_flash.mods import trace_mask_mod, trace_score_mod
from cute_flash.mods.graph import evaluate
from cute_flash.mods.probe import run_probe

from . import test_mods as examples

pytestmark = pytest.mark.sm80  # plain loads and arithmetic: any GPU that runs cute-flash


def _inputs(n=4096, seq=77):
    g = torch.Generator().manual_seed(5)
    return {
        "score": torch.randn(n, generator=g) * 8,
        "b": torch.randint(0, examples.B, (n,), generator=g),
        "h": torch.randint(0, examples.H, (n,), generator=g),
        "q_idx": torch.randint(0, seq, (n,), generator=g),
        "kv_idx": torch.randint(0, seq, (n,), generator=g),
    }


@pytest.mark.parametrize("fn", examples.SCORE_MODS + examples.MASK_MODS, ids=lambda f: f.__name__)
def test_probe_matches_the_graph(fn):
    score_mod = fn in examples.SCORE_MODS
    graph = trace_score_mod(fn) if score_mod else trace_mask_mod(fn)
    x = _inputs()
    want = evaluate(graph, x).expand(x["b"].shape)
    cuda = {k: v.cuda() for k, v in x.items()}
    graph_cuda = type(graph)(graph.kind, graph.nodes, tuple(t.cuda() for t in graph.aux), graph.aux_types)
    got = run_probe(graph_cuda, cuda["score"] if score_mod else None, cuda["b"], cuda["h"], cuda["q_idx"],
                    cuda["kv_idx"]).cpu()  # fmt: skip
    if score_mod:
        torch.testing.assert_close(got.double(), want.double(), rtol=2e-6, atol=2e-6)
    else:
        assert torch.equal(got.bool(), want)
