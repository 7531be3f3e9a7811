"""A resource budget for rendering a checkpoint's chat template: time, output size and the size of any string or
list it builds. A template is code shipped with a checkpoint; jinja2's sandbox keeps it from Python's internals but
not from looping for hours or building a string of gigabytes. Each is refused here with a one-line error:

- time: a trace function, set for the render only, checks a deadline at every line the template's code runs
  (jinja2 compiles templates to Python), so nested loops and recursive macros stop at the deadline;
- size: `*`, `**` and `+` are checked before they run (the sandbox's operator hook), `~` as it joins, every
  filter and call given a count over the limit before it runs (`'a'|center(10**9)`, `' '.ljust(n)`), and the
  output as it streams.
"""

from __future__ import annotations

import sys
import time

MAX_CHARS = 1 << 22  # 4 Mi characters: far above any prompt a model takes, far below what exhausts memory
RENDER_SECONDS = 2.0  # real templates render in milliseconds


class BudgetExceeded(Exception):
    """A template ran out of its time or size budget."""


def _sized(value) -> int:
    return len(value) if isinstance(value, str | bytes | list | tuple) else 0


def _check_counts(args, kwargs) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_CHARS:
            raise BudgetExceeded(f"a count of {value} is over the template budget of {MAX_CHARS}")


def _check_binop(operator: str, left, right) -> None:
    if operator == "*":
        count = right if _sized(left) else left if _sized(right) else None
        if isinstance(count, int) and count * max(_sized(left), _sized(right)) > MAX_CHARS:
            raise BudgetExceeded(f"a repetition to {count} items is over the template budget of {MAX_CHARS}")
    elif operator == "**":
        if isinstance(right, int) and isinstance(left, int) and abs(left) > 1 and right > 64:
            raise BudgetExceeded(f"the power {left} ** {right} is over the template budget")
    elif operator == "+" and _sized(left) + _sized(right) > MAX_CHARS:
        raise BudgetExceeded(f"a concatenation to {_sized(left) + _sized(right)} items is over the template budget")


def budgeted(env_class):
    """A subclass of jinja2's sandbox `env_class` whose operators, calls and filters stay within the budget."""

    class Budgeted(env_class):
        intercepted_binops = frozenset({"*", "**", "+"})

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
            _check_counts(args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    return Budgeted


def bounded_filters(filters: dict) -> dict:
    """`filters`, each refusing a count over the budget before it runs (templates call filters directly)."""

    def bounded(function):
        passed = getattr(function, "jinja_pass_arg", None)  # jinja2 passes a context or environment first
        skip = 2 if passed is not None else 1  # and then the filtered value, which may be any number

        def run(*args, **kwargs):
            _check_counts(args[skip:], kwargs)
            return function(*args, **kwargs)

        if passed is not None:
            run.jinja_pass_arg = passed
        return run

    return {name: bounded(function) for name, function in filters.items()}


def bound_joins(template) -> None:
    """Make `~` in `template` refuse a result over the budget: the compiled code joins with `str_join` and
    `markup_join` from its module's globals, which no sandbox hook sees."""
    namespace = template.root_render_func.__globals__
    for name in ("str_join", "markup_join"):
        join = namespace.get(name)
        if join is not None and not getattr(join, "budgeted", False):

            def checked(seq, join=join):
                text = join(seq)
                if len(text) > MAX_CHARS:
                    raise BudgetExceeded(f"a joined string of {len(text)} characters is over the template budget")
                return text

            checked.budgeted = True
            namespace[name] = checked


def render_bounded(template, seconds: float = RENDER_SECONDS, max_chars: int = MAX_CHARS, **variables) -> str:
    """`template` rendered with `variables`, else BudgetExceeded once it runs past `seconds` or writes over
    `max_chars` characters."""
    deadline = time.monotonic() + seconds

    def trace(frame, event, arg):
        if time.monotonic() > deadline:
            raise BudgetExceeded(f"rendering took over {seconds:g} s")
        return trace

    previous, chunks, size = sys.gettrace(), [], 0
    sys.settrace(trace)
    try:
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > max_chars:
                raise BudgetExceeded(f"the rendered text is over {max_chars} characters")
            chunks.append(chunk)
    finally:
        sys.settrace(previous)
    return "".join(chunks)
