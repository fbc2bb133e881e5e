"""`python -m gguf_assets.studio.dagster_ui --host H --port P [--allow-host NAME]...`: Dagster's own
webserver, unchanged but for guard.py's middleware around its ASGI app (the Host allow-list, the Origin check,
the body cap). Its GraphQL endpoint can launch, terminate and delete runs and wipe asset records, so it must not
answer a page that rebinds a name of its own to 127.0.0.1.

dagster-webserver builds its app in ``create_app_from_workspace_process_context`` and hands it to uvicorn in
the same function; its CLI (options, instance set-up, shutdown) is kept whole by wrapping that one factory as
the CLI module looks it up. test_security.py checks through the real server that the wrap took effect, so a
dagster-webserver release that renames it fails the suite instead of serving unguarded.
"""

from __future__ import annotations

import argparse
import sys

from gguf_assets import DEFINITIONS_MODULE
from gguf_assets.studio.guard import DAGSTER_UI_BODY_LIMIT, guarded


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gguf_assets.studio.dagster_ui")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=3000)
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME")
    # The project's one code server (cli/services.py CodeServer), else a code server of the webserver's own.
    parser.add_argument("--workspace", metavar="FILE")
    args, passed_on = parser.parse_known_args(argv)  # the rest goes to dagster-webserver as it is

    import dagster_webserver.cli as webserver_cli

    from gguf_assets.pipeline.private_api import reuse_sqlite_engines

    reuse_sqlite_engines()  # the webserver's own storage reads (runs, events) for every page

    make_app = webserver_cli.create_app_from_workspace_process_context

    def guarded_app(*factory_args, **factory_kwargs):
        return guarded(make_app(*factory_args, **factory_kwargs), bind_host=args.host, extra_hosts=args.allow_host,
                       body_limit=DAGSTER_UI_BODY_LIMIT, server="the Dagster UI")

    webserver_cli.create_app_from_workspace_process_context = guarded_app
    code = ["-w", args.workspace] if args.workspace else ["-m", DEFINITIONS_MODULE]
    sys.argv = ["dagster-webserver", *code, "-h", args.host, "-p", str(args.port), *passed_on]
    webserver_cli.main()


if __name__ == "__main__":
    main()
