"""One example invocation per command, shown at the end of its ``--help`` (``Example:``).

Commands whose docstring already ends with an example are left as they are; :func:`attach` gives every
other command of the tree its line(s) from :data:`EXAMPLES` (keyed by the command's path). A test checks
that every command has one.
"""

from __future__ import annotations

import click

H = "0123456789abcdef01234567"  # a route hash as `magpie routes` prints them

EXAMPLES: dict[str, list[str]] = {
    "db upgrade": ["magpie db upgrade"],
    "db downgrade": ["magpie db downgrade -1 --yes"],
    "db current": ["magpie db current"],
    "db history": ["magpie db history"],
    "db check": ["magpie db check"],
    "import": ["magpie import proxies.txt --workspace acme",
               "curl -s https://lists.example/p.txt | magpie import - -w acme --dry-run"],
    "status": ["magpie status --json"],
    "init": ["magpie init ./deploy", "magpie init ./deploy --force --json"],
    "routes": ["magpie routes --workspace acme --json"],
    "queue pause": ["magpie queue pause"],
    "queue resume": ["magpie queue resume"],
    "queue inspect": [f"magpie queue inspect {H} --json"],
    "queue migrate-payloads": ["PROXY_QUEUE_ENCRYPT_CREDENTIALS=true magpie queue migrate-payloads --encrypt"],
    "queue remove": [f"magpie queue remove {H}"],
    "queue logs": [f"magpie queue logs {H}"],
    "queue progress": [f"magpie queue progress {H}"],
    "queue dead": ["magpie queue dead --limit 20 --json"],
    "queue reprocess": [f"magpie queue reprocess {H}"],
    "queue check-now": [f"magpie queue check-now {H} --in 30"],
    "queue interval": ["magpie queue interval --json"],
    "queue claim": ["TOKEN=$(magpie queue claim --wait 10)"],
    "queue heartbeat": ['magpie queue heartbeat "$TOKEN"'],
    "queue complete": ['magpie queue complete "$TOKEN"'],
    "queue in-flight": ["magpie queue in-flight --limit 20"],
    "check": ["magpie check proxies.txt --judge http://judge.example:8899/ --timeout 5"],
    "judge": ["magpie judge --host 127.0.0.1 --port 8899"],
    "lab": ["magpie lab --base-port 18080"],
    "alerts rules list": ["magpie alerts rules list --workspace acme"],
    "alerts rules create": ["magpie alerts rules create -w acme few-usable --kind usable_routes --threshold 50"],
    "alerts rules edit": ["magpie alerts rules edit 3 --threshold 40 --expected-revision 2"],
    "alerts rules enable": ["magpie alerts rules enable 3"],
    "alerts rules disable": ["magpie alerts rules disable 3"],
    "alerts rules delete": ["magpie alerts rules delete 3"],
    "alerts channels list": ["magpie alerts channels list --workspace acme"],
    "alerts channels add-webhook": ["magpie alerts channels add-webhook -w acme ops https://hooks.example/magpie"],
    "alerts channels add-email": ["magpie alerts channels add-email -w acme oncall ops@example.com"],
    "alerts channels enable": ["magpie alerts channels enable 2"],
    "alerts channels disable": ["magpie alerts channels disable 2"],
    "alerts channels delete": ["magpie alerts channels delete 2"],
    "alerts evaluate": ["magpie alerts evaluate --json"],
    "alerts incidents": ["magpie alerts incidents --status recovered --limit 20"],
    "alerts deliveries": ["magpie alerts deliveries --status failed"],
    "alerts retry": ["magpie alerts retry 17"],
    "alerts deliver": ["magpie alerts deliver --workers 4 --once"],
    "outbox status": ["magpie outbox status"],
    "outbox list": ["magpie outbox list --status failed --limit 20"],
    "outbox send": ['magpie outbox send ops@example.com "test" "hello from magpie"'],
    "outbox retry": ["magpie outbox retry 5"],
    "outbox work": ["magpie outbox work --workers 2 --once"],
    "outbox housekeep": ["magpie outbox housekeep"],
    "maintenance run": ["magpie maintenance run retention --max-seconds 60", "magpie maintenance run all --json"],
    "maintenance status": ["magpie maintenance status --json"],
    "metrics": ["magpie metrics --host 127.0.0.1 --port 9101"],
    "health": ["magpie health --timeout 2 --json"],
    "keys status": ["magpie keys status"],
    "keys export": ["magpie keys export /srv/magpie/keys-backup"],
    "stats status": ["magpie stats status --json"],
    "stats redrive": ["magpie stats redrive --limit 1000"],
    "stats timeline": ["magpie stats timeline --workspace acme --hours 24"],
    "stats hourly": ["magpie stats hourly --workspace acme --hours 48"],
    "stats sources": ["magpie stats sources --workspace acme"],
    "stats usage": ["magpie stats usage --workspace acme --days 7"],
    "judges add": ["magpie judges add https://judge.example/echo --workspace acme"],
    "judges remove": ["magpie judges remove 2"],
    "judges rate": ["magpie judges rate 2 50", "magpie judges rate https://judge.example/echo default"],
    "judges list": ["magpie judges list --json"],
    "judges check": ["magpie judges check 2"],
    "profiles show": ["magpie profiles show acme"],
    "profiles set": ["magpie profiles set acme --protocols http,socks5 --timeout 8"],
    "blacklists add": ["magpie blacklists add spamhaus-drop https://lists.example/drop.txt"],
    "blacklists list": ["magpie blacklists list --json"],
    "blacklists remove": ["magpie blacklists remove spamhaus-drop"],
    "blacklists policy": ["magpie blacklists policy acme remove"],
    "blacklists refresh": ["magpie blacklists refresh --json"],
    "instances": ["magpie instances --role worker"],
    "rotators add": ["magpie rotators add eu-pool --workspace acme --listen http,socks5 --policy sticky "
                     "--sticky-seconds 300"],
    "rotators update": ["magpie rotators update eu-pool --max-latency 800"],
    "rotators remove": ["magpie rotators remove eu-pool"],
    "rotators list": ["magpie rotators list --json"],
    "rotator": ["MAGPIE_ROTATOR_METRICS_PORT=9102 magpie rotator"],
    "web": ["MAGPIE_WEB_TOKEN=... magpie web --host 127.0.0.1 --port 8080"],
    "export": ["magpie export --workspace acme --alive --protocol socks5 --max-latency 800 --format url",
               "magpie export --workspace acme --min-score 70 --format csv -o good.csv"],
}


def walk(group: click.Group, path: tuple[str, ...] = ()):
    """Every leaf command under ``group`` as ``(path, command)``; ``path`` like ``("queue", "drain")``."""
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from walk(cmd, path + (name,))
        else:
            yield path + (name,), cmd


def attach(root: click.Group) -> None:
    """Give each command without an example in its help its :data:`EXAMPLES` entry as the epilog."""
    for path, cmd in walk(root):
        lines = EXAMPLES.get(" ".join(path))
        if lines and "Example" not in (cmd.help or "") and not cmd.epilog:
            cmd.epilog = "\b\nExample:\n" + "\n".join(f"  {line}" for line in lines)
