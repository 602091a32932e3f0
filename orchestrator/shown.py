"""A value as the orchestrator's error messages show it: its ``repr``, cut short, so that a client's huge input (an
integer of 300 digits, a schema of 60,000 characters) does not come back whole in the message naming it."""


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters, with its full length after a cut; an integer too long for that
    in scientific notation (``1e300`` sent as ``max_tokens`` is taken as an integer of 301 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and len(repr(value)) > limit:
        digits, sign = str(abs(value)), "-" if value < 0 else ""
        return f"{sign}{digits[0]}.{digits[1:4]}e{len(digits) - 1} (an integer of {len(digits)} digits)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
