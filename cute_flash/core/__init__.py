"""The call core: everything between the public functions (`cute_flash.attention`, `attention_varlen`, the custom ops,
the ring, the plug-ins) and a kernel family's backend.

  fields.py       the call's fields: the plan cache's key, the C++ call path's key layout, the custom ops' schema
  device.py       the GPU a call runs on: compute capability, device guard, route (tests replace these)
  plan.py         validated, routed plans cached per call signature (dense, packed, FP8)
  launch.py       the one forward launcher and the one backward launcher (decoding's GQA packing, sink views)
  autograd.py     the autograd node of every differentiable call (eager dense and packed, ring)
  native_path.py  the C++ call path of warm no-grad forwards (cute_flash/native.py builds it)
  call.py         what `attention` / `attention_varlen` do with a call: C++ path, plan, autograd, torch.compile, FP8

The custom ops themselves are cute_flash/ops.py (they run planned calls through launch.py).
"""
