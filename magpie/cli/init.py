"""``magpie init DIR``: write the files a deployment runs from (Procfile, Celery and Flower settings,
``alembic.ini``, the Prometheus rules and the Grafana dashboard; see :mod:`magpie.base.deployment`)."""

from __future__ import annotations

import click

from magpie.cli.context import CliState, json_option, pass_state
from magpie.cli.output import echo_json
from magpie.errors import MagpieError


@click.command("init")
@click.argument("directory", type=click.Path(file_okay=False, path_type=str))
@click.option("--force", is_flag=True, help="Overwrite files that exist (default: refuse, write nothing).")
@json_option
@pass_state
def init(state: CliState, directory: str, force: bool, as_json: bool) -> None:
    """Write a deployment's files into DIRECTORY (created if missing): Procfile, celeryconfig.py,
    flowerconfig.py, alembic.ini, deploy/prometheus/rules.yml, deploy/grafana/magpie.json. Run honcho,
    celery and alembic from there."""
    from magpie.base import deployment

    try:
        written = deployment.write(directory, force=force)
    except FileExistsError as exc:
        raise MagpieError(f"{exc.filename} exists; nothing written (--force overwrites)") from None
    except (FileNotFoundError, NotADirectoryError, PermissionError) as exc:
        raise MagpieError(f"cannot write the deployment files: {exc.filename}: {exc.strerror}") from None
    if as_json:
        echo_json({"written": [str(p) for p in written]})
        return
    for path in written:
        click.echo(str(path))


COMMANDS = [init]
