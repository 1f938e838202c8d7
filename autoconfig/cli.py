"""The ``autoconfig`` command line.

``autoconfig check CONFIG``  validate a Ray Serve config file, application ``args`` included, and
                             show what it would deploy.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from autoconfig import __version__


def _check(args: argparse.Namespace, console: Console) -> int:
    from serving.common.serve_config import ServeConfigError, load_serve_config

    try:
        config = load_serve_config(args.config)
    except ServeConfigError as exc:
        console.print(f"[red]invalid:[/red] {exc}")
        return 1
    table = Table(title=f"{args.config} (HTTP {config.http_options.host}:{config.http_options.port})")
    for column in ("application", "route", "import path", "deployment", "replicas", "resources"):
        table.add_column(column)
    for app in config.applications:
        for deployment in app.deployments or []:
            fields = deployment.model_dump(exclude_unset=True)
            table.add_row(app.name, app.route_prefix, app.import_path, deployment.name,
                          str(fields.get("num_replicas", "default")), str(fields.get("ray_actor_options", {})))
    console.print(table)
    console.print(f"[green]ok:[/green] {len(config.applications)} application(s) valid")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autoconfig", description="Configure swiftserve deployments.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="validate a Ray Serve config file and its application args")
    check.add_argument("config", help="path to a Serve config YAML (e.g. deploy/serve_config.yaml)")
    check.set_defaults(run=_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args, Console())


if __name__ == "__main__":
    sys.exit(main())
