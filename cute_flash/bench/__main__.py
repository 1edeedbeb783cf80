"""`python -m cute_flash.bench` runs the same command as `python -m cute_flash bench`."""

import argparse
import sys

from .cli import add_arguments, main

parser = argparse.ArgumentParser(prog="python -m cute_flash.bench", description=__doc__)
add_arguments(parser)
sys.exit(main(parser.parse_args()))
