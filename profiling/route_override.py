"""Run a `python -m cute_flash` command with the sm90 backward's routing changed, to time one route against
another in separate processes (GPU).

    python3 -m profiling.route_override [--without-tile D ...] [--config D KEY=VALUE ...] -- bench --shape ...

--without-tile D: the sm90 backward forgets its head-dim-D tile and the (D, DV) pairs' own, so they run on the next
    wider tile, zero-padded (e.g. `--without-tile 192`: d192 and (192, 128) on the d256 kernels, as before session 20).
--config D[,DV] KEY=VALUE: one field of the head-dim-D (or (D, DV)) tile configuration changed (a Python literal),
    e.g. `--config 192 dq_red=False` (d192 only: (192, 128) has its own entry), `--config 192,128 num_stages=3`
    (repeatable).
(The sm80 backward's own tiles for a head dim the sm90 backward serves padded: `CUTE_FLASH_ARCH=sm80 python3 -m
cute_flash bench ... --directions bwd`; session 20's `--padded-everywhere` compared them while the sm90 backward left
d32 / d160 / d224 to them.)
"""

import argparse
import ast
import sys
from dataclasses import replace

from cute_flash.arch.sm90 import tile_config
from cute_flash.cli import main as cli_main


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--without-tile", type=int, action="append", default=[])
    parser.add_argument("--config", nargs=2, action="append", default=[], metavar=("D[,DV]", "KEY=VALUE"))
    args = parser.parse_args(argv[:split])
    for dims, change in args.config:
        key, value = change.split("=", 1)
        d, _, dv = dims.partition(",")
        table, entry = tile_config._BWD_BY_HEAD_DIM, int(d)
        if dv:
            table, entry = tile_config._BWD_BY_HEAD_DIMS, (int(d), int(dv))
        table[entry] = replace(table[entry], **{key: ast.literal_eval(value)})
    for d in args.without_tile:
        del tile_config._BWD_BY_HEAD_DIM[d]
        for pair in [p for p in tile_config._BWD_BY_HEAD_DIMS if p[0] == d]:
            del tile_config._BWD_BY_HEAD_DIMS[pair]
    print(f"route override: {vars(args)}", flush=True)
    return cli_main(argv[split + 1 :])


if __name__ == "__main__":
    sys.exit(main())
