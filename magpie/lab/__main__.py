"""``python -m magpie.lab [--base-port N] [--judge-port N] [--slow-delay S] [--list-file PATH] [--faults]``."""

from magpie.lab.lab import main

raise SystemExit(main())
