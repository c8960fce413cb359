"""``python -m magpie.lab [--base-port N] [--judge-port N] [--slow-delay S] [--list-file PATH] [--faults]``:
the same as ``magpie lab`` (:mod:`magpie.cli.lab`)."""

import sys

from magpie.cli import main

main(["lab", *sys.argv[1:]], prog_name="magpie")
