"""`python -m gguf_assets.cli`: the same program as `gguf-trainer`."""

import sys

from gguf_assets.cli import main

sys.exit(main())
