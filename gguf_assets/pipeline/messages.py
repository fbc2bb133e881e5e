"""The one line a user reads for a failed step: the console logger's (defs/console.py) and a run's outcome's
(orchestration/run_outcomes.py)."""


def user_message(error) -> str:
    """One line for a failed step's error (a SerializableErrorInfo): the message alone for a
    UserError, whose message names the fix; the type and message for anything else (a bug)."""
    from gguf_assets.lib.core.errors import user_error_names

    error = error.cause or error
    text = error.message.strip()
    if error.cls_name in user_error_names() and ": " in text.splitlines()[0]:
        text = text.split(": ", 1)[1]
    return " ".join(text.split())
