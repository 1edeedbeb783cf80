"""Context parallelism: exact attention over a sequence sharded along its length over GPUs (ring attention).

Imported on its own (`import cute_flash.distributed`); `import cute_flash` does not import it or torch.distributed.
See docs/distributed.md.
"""

from .blocks import BlockCompute, KernelBlocks, ReferenceBlocks
from .layout import LAYOUTS, gather_sequence, global_positions, shard_sequence, unshard_sequence
from .merge import merge
from .ring import ring_attention

__all__ = [
    "BlockCompute",
    "KernelBlocks",
    "LAYOUTS",
    "ReferenceBlocks",
    "gather_sequence",
    "global_positions",
    "merge",
    "ring_attention",
    "shard_sequence",
    "unshard_sequence",
]
