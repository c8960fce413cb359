"""``magpie lab`` (also ``python -m magpie.lab``): run the local lab on loopback until SIGINT/SIGTERM.

It prints ``judge: <url>``, with ``--faults`` a line ``faults: {"tarpit": "host:port", ...}`` (the fault
servers are not in the proxy list), optionally ``list written to <path>``, then the proxy list with
what a correct checker must report for each proxy, a ``# note:`` line when ``MAGPIE_CHECK_ALLOW_PRIVATE``
does not allow loopback yet (the egress guard refuses the lab's 127.0.0.x addresses by default), and
``running; Ctrl-C to stop``. A port in use is
an error (exit status 2, the message names the address); a clean stop exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import click

from magpie.cli.context import user_errors


@contextmanager
def _stop_on_signal() -> Iterator[threading.Event]:
    """An event set by SIGINT or SIGTERM while the block runs (handlers restored after; main thread only)."""
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


LOOPBACK_HINT = ("# note: checks against the lab need MAGPIE_CHECK_ALLOW_PRIVATE=127.0.0.0/8 "
                 "(the egress guard refuses loopback by default)")


def _needs_loopback_hint(addresses: list[str]) -> bool:
    """True unless ``MAGPIE_CHECK_ALLOW_PRIVATE`` (environment or ``.env``) already allows every one of
    ``addresses``."""
    from magpie.config import load_settings
    from magpie.base.egress import EgressPolicy

    try:
        allow = load_settings().check_allow_private
    except ValueError:  # another setting is bad: the lab does not need it
        allow = os.environ.get("MAGPIE_CHECK_ALLOW_PRIVATE", "false")
    try:
        policy = EgressPolicy(allow)
    except ValueError:
        return True
    return any(policy.refusal(a) is not None for a in addresses)


@click.command()
@click.option("--base-port", default=18080, show_default=True, type=click.IntRange(1024, 65527),
              help="First proxy port (8 ports are used).")
@click.option("--judge-port", default=8899, show_default=True, type=click.IntRange(0, 65535),
              help="Judge port on 127.0.0.1 (0: any free port).")
@click.option("--slow-delay", default=3.0, show_default=True, type=click.FloatRange(0, 60),
              help="Seconds the slow proxy waits before forwarding.")
@click.option("--list-file", default=None, type=click.Path(dir_okay=False),
              help="Also write the proxy list here.")
@click.option("--faults", is_flag=True,
              help="Also start the fault servers (tarpit, trickle, slow, echo, refused) on 127.0.0.20-24, "
                   "ports base-port+8 to +12.")
def lab(base_port: int, judge_port: int, slow_delay: float, list_file: str | None, faults: bool) -> None:
    """Start the local lab (a judge and real proxy servers on 127.0.0.x) and run until stopped."""
    from magpie.lab.faults import FaultLab
    from magpie.lab.lab import PROXY_COUNT, Lab

    the_lab = Lab(base_port, judge_port, slow_delay)
    fault_lab = None
    if faults:
        with user_errors(ValueError):
            fault_lab = FaultLab(base_port=base_port + PROXY_COUNT, slow_delay=slow_delay,
                                 judge_port=judge_port)
    with _stop_on_signal() as stop:
        try:
            the_lab.start()
            if fault_lab is not None:
                fault_lab.start()
            click.echo(f"judge: {the_lab.judge_url}")
            if fault_lab is not None:
                click.echo(f"faults: {json.dumps(fault_lab.addresses)}")
            if list_file:
                the_lab.write_list(list_file)
                click.echo(f"list written to {list_file}")
            click.echo(the_lab.proxy_list_text(), nl=False)
            for p in the_lab.proxies:
                expect = f"alive, {p.expect_anonymity}" if p.expect_alive else "dead"
                extra = f", {p.delay:g} s delay" if p.delay else ""
                click.echo(f"#   {p.name:<17} {p.route.display():<40} expect {expect}{extra}")
            if _needs_loopback_hint(["127.0.0.1", *(p.route.host for p in the_lab.proxies)]):
                click.echo(LOOPBACK_HINT)
            click.echo("running; Ctrl-C to stop")
            while not stop.wait(0.5):
                pass
        finally:
            if fault_lab is not None:
                fault_lab.stop()
            the_lab.stop()


COMMANDS = [lab]
