"""``python -m magpie`` runs the command line."""

from magpie.cli import main

main(prog_name="magpie")
