"""Keep the libraries' own console output out of the user's console.

transformers prints a load report per model (with ANSI codes, listing an unused lm_head as
UNEXPECTED, which reads like an error) and progress bars for loading and saving; the hub client
prints download bars. The pipeline reports its own progress, so these are switched off before
any model is loaded or saved. Real problems still come through as errors.
"""

from __future__ import annotations

_done = False


def quiet_libraries() -> None:
    global _done
    if _done:
        return
    import transformers
    from huggingface_hub.utils import disable_progress_bars

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    disable_progress_bars()
    _done = True
