"""`python -m gguf_assets.studio DIR --host H --port P`: serve one project's studio page (gguf-trainer ui starts it)."""

import argparse
import logging

import uvicorn

from gguf_assets.studio.app import build_app
from gguf_assets.studio.guard import STUDIO_BODY_LIMIT, guarded


def main() -> None:
    parser = argparse.ArgumentParser(prog="gguf_assets.studio")
    parser.add_argument("project")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=3001)
    parser.add_argument("--dagster-url", default="")
    parser.add_argument("--tensorboard-url", default="")
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                        help="another host name the page may be opened under (default: loopback and --host)")
    parser.add_argument("--no-spare-run", action="store_true",
                        help="keep no run loaded ahead of Run (its memory and loading CPU saved; Run starts seconds "
                             "later)")
    args = parser.parse_args()
    from gguf_assets.lib.project.layout import ProjectPaths
    from gguf_assets.orchestration.instance import prepare_instance

    prepare_instance(ProjectPaths.of(args.project))  # the project's own Dagster instance (as `ui` sets it up)
    app = guarded(build_app(args.project, dagster_url=args.dagster_url, tensorboard_url=args.tensorboard_url,
                            spare_run=not args.no_spare_run),
                  bind_host=args.host, extra_hosts=args.allow_host, body_limit=STUDIO_BODY_LIMIT,
                  server="the studio")
    # uvicorn's access log would print every 2-second refresh; errors still come through.
    uvicorn.run(app, host=args.host, port=args.port, log_level=logging.WARNING, access_log=False)


if __name__ == "__main__":
    main()
