"""`python -m gguf_assets.studio.tensorboard --logdir D --host H --port P [--allow-host NAME]...`: TensorBoard, as
its own `tensorboard` command serves it, behind guard.py's Host allow-list (through the ``server_class`` hook
TensorBoard's program API offers). It only reads the event files, but a rebinding page could otherwise read
every training curve and run name of the project."""

from __future__ import annotations

import argparse
import sys

from gguf_assets.studio.guard import STUDIO_BODY_LIMIT, wsgi_guarded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gguf_assets.studio.tensorboard")
    parser.add_argument("--logdir", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=6006)
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME")
    args = parser.parse_args(argv)
    from tensorboard import default, main_lib, program

    def guarded_server(wsgi_app, flags):
        return program.WerkzeugServer(wsgi_guarded(wsgi_app, bind_host=args.host, extra_hosts=args.allow_host,
                                                   body_limit=STUDIO_BODY_LIMIT, server="TensorBoard"), flags)

    main_lib.global_init()
    board = program.TensorBoard(plugins=default.get_plugins(), server_class=guarded_server)
    board.configure(argv=["tensorboard", "--logdir", args.logdir, "--host", args.host, "--port", str(args.port)])
    return board.main()


if __name__ == "__main__":
    sys.exit(main())
