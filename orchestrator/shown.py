"""A value as the orchestrator's error messages show it: its ``repr``, cut short, so that a client's huge input (an
integer of 300 digits, a schema of 60,000 characters) does not come back whole in the message naming it."""


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters, with its full length after a cut."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
