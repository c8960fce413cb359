"""The Redis scripts, one file per state transition (``lib.lua`` is the prelude of each); installed as the
package ``magpie.lua`` and read with ``importlib.resources``."""
