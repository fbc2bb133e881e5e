"""`python -m gguf_assets.studio DIR --host H --port P`: serve one project's studio page (gguf-trainer ui starts it)."""

import argparse
import logging

import uvicorn

from gguf_assets.studio.app import build_app


def main() -> None:
    parser = argparse.ArgumentParser(prog="gguf_assets.studio")
    parser.add_argument("project")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=3001)
    parser.add_argument("--dagster-url", default="")
    parser.add_argument("--tensorboard-url", default="")
    args = parser.parse_args()
    app = build_app(args.project, dagster_url=args.dagster_url, tensorboard_url=args.tensorboard_url)
    # uvicorn's access log would print every 2-second refresh; errors still come through.
    uvicorn.run(app, host=args.host, port=args.port, log_level=logging.WARNING, access_log=False)


if __name__ == "__main__":
    main()
