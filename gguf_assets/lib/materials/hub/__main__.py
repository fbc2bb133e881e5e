"""``python -m gguf_assets.lib.materials.hub``: the child process that runs one hub request (see ``child``)."""

from gguf_assets.lib.materials.hub.child import main

main()
