"""Chat templates rendered in Jinja's sandbox, with limits on time and size.

Every chat template renders here: the model's (from its tokenizer) and, when
the server allows it, one a client sends. Jinja's ImmutableSandboxedEnvironment
stops templates from reaching Python internals or mutating their inputs, as
transformers' renderer does. It does not stop a template from running for
hours or building a string of gigabytes, so this environment adds a budget per
render, kept in a thread-local and checked at every point a template can do
work:

- time: a deadline, checked at each loop iteration (every `for` loop's
  iterable is wrapped when the template compiles), call, attribute or item
  lookup, operator, filter and output;
- size: no single value may exceed `max_chars` (its printed size, shared
  references counted every time they print): checked where values grow
  (`*`, `+`, `%`, `~`, string methods and filters that pad or repeat) before
  the work is done, and where they are printed or joined;
- output: the rendered text, and all text produced along the way (macros,
  `{% set %}` blocks), are bounded by `max_chars` and a few times it.

The variables a template sees are transformers' (raise_exception,
strftime_now, a `tojson` that keeps non-ASCII, `dict`, `namespace`; trim and
lstrip blocks; `{% generation %}` and loop controls), so model templates
render as they do through `apply_chat_template`.
"""

from __future__ import annotations

import functools
import json
import re
import string
import threading
import time
from collections.abc import Callable, Iterator, Sized
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

MAX_INT_BITS = 1 << 16  # ints past ~20,000 digits: no chat template needs them
MAX_FORMAT_WIDTH = 10_000  # widths and precisions in % and str.format specs
MAX_SIZE_ARG = 100_000  # width/count arguments of padding and batching filters (as range())
MAX_TOJSON_INDENT = 16
OUTPUT_FACTOR = 4  # all text produced while rendering: at most this many times max_chars
TICK_STEPS = 1 << 14  # walk steps between deadline checks


class TemplateBudgetError(SecurityError):
    """A template went past its budget (time or size); the render stops."""


class TemplateTimeoutError(TemplateBudgetError):
    """The render's deadline passed."""


class TemplateSizeError(TemplateBudgetError):
    """A value, or the output, would exceed the size limit."""


@dataclass
class _Budget:
    deadline: float
    max_chars: int
    produced: int = 0  # characters printed or joined so far, nested blocks included
    known: dict[int, int] = field(default_factory=dict)  # id -> size of the inputs' containers


_local = threading.local()


def _budget() -> _Budget:
    budget = getattr(_local, "budget", None)
    if budget is None:
        # Compiled templates may only run inside render(): never unlimited.
        raise TemplateBudgetError("a chat template ran outside a render budget")
    return budget


def _tick() -> _Budget:
    budget = _budget()
    if time.monotonic() > budget.deadline:
        raise TemplateTimeoutError("the chat template ran past its time limit")
    return budget


@contextmanager
def _render_budget(deadline: float, max_chars: int) -> Iterator[_Budget]:
    budget = _Budget(deadline, max_chars)
    _local.budget = budget
    try:
        yield budget
    finally:
        _local.budget = None


# -- sizes ----------------------------------------------------------------------------


def _children(value: Any) -> Iterator[Any] | None:
    if isinstance(value, (list, tuple, set, frozenset, range)):
        return iter(value)
    if isinstance(value, dict):
        return iter([*value.keys(), *value.values()])
    if isinstance(value, Namespace):
        return iter([object.__getattribute__(value, "_Namespace__attrs")])
    return None


def size_of(value: Any, limit: int | None = None) -> int:
    """About how many characters `value` prints as (str, tojson); stops past `limit`.

    A list holding the same big string ten times counts it ten times: that is
    what printing it costs. The inputs' containers are sized once per render.
    """
    budget = _budget()
    limit = budget.max_chars if limit is None else limit
    total, steps, stack = 0, 0, [value]
    while stack:
        item = stack.pop()
        steps += 1
        if steps % TICK_STEPS == 0:
            _tick()
        if isinstance(item, (str, bytes, bytearray)):
            total += len(item) + 2
        elif isinstance(item, bool) or item is None:
            total += 5
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 2
        elif isinstance(item, float):
            total += 24
        elif (known := budget.known.get(id(item), -1)) >= 0:
            total += known
        elif (children := _children(item)) is not None:
            total += 2
            stack.extend(children)
        else:
            total += 16  # Undefined, loop objects, macros: short reprs
        if total > limit:
            break
    return total


def _size_inputs(budget: _Budget, variables: dict[str, Any]) -> None:
    """Size every container of the render's inputs once (children before parents).

    Templates read `messages` in every loop iteration; without this, checking
    the size of `messages|length`'s argument would cost O(messages) each time.
    """
    order: list[Any] = []
    stack = list(variables.values())
    while stack:
        item = stack.pop()
        children = _children(item)
        if children is not None and id(item) not in budget.known:
            budget.known[id(item)] = -1  # visited
            order.append(item)
            stack.extend(children)
    for container in reversed(order):
        # Children first, so each container costs its own length (a child met
        # twice, through two parents, may be walked once more).
        size = 2
        for child in _children(container) or ():
            known = budget.known.get(id(child), -1)
            size += known if known >= 0 else size_of(child, 1 << 62)
        budget.known[id(container)] = size


def _check_size(size: int, what: str) -> None:
    limit = _budget().max_chars
    if size > limit:
        raise TemplateSizeError(f"{what} would exceed {limit} characters")


def _count_output(size: int) -> None:
    budget = _budget()
    _check_size(size, "one value of the rendered prompt")
    budget.produced += size
    if budget.produced > OUTPUT_FACTOR * budget.max_chars:
        raise TemplateSizeError(
            f"the template produced more than {OUTPUT_FACTOR * budget.max_chars} characters"
        )


_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\*|\d+)?(?:\.(\*|\d+))?")


def _too_wide(number: str) -> bool:
    return len(number) > 5 or int(number) > MAX_FORMAT_WIDTH  # no int() of 5,000 digits


def _check_printf(fmt: str) -> None:
    for width, precision in _PRINTF_SPEC.findall(fmt):
        for number in (width, precision):
            if number == "*" or (number and _too_wide(number)):
                raise TemplateSizeError(f"format widths are limited to {MAX_FORMAT_WIDTH}")


def _check_format_spec(fmt: str) -> None:
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # str.format raises the same error when called
    for _, _, spec, _ in fields:
        if spec and ("{" in spec or any(_too_wide(n) for n in re.findall(r"\d+", spec))):
            raise TemplateSizeError(f"format widths are limited to {MAX_FORMAT_WIDTH}")


# -- what templates may call ----------------------------------------------------------


def _raise_exception(message: Any) -> None:
    text = message if isinstance(message, str) else repr(message)[:500]
    raise jinja2.TemplateError(text[:500])


def _strftime_now(fmt: str) -> str:
    if not isinstance(fmt, str) or len(fmt) > 200:
        raise TemplateSizeError("strftime_now takes a format of at most 200 characters")
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Like transformers' tojson: no HTML escaping, non-ASCII kept.
    width = len(indent) if isinstance(indent, str) else (indent or 0)
    short_separators = separators is None or (
        isinstance(separators, (list, tuple))
        and all(isinstance(s, str) and len(s) <= 16 for s in separators)
    )
    if not isinstance(width, int) or width > MAX_TOJSON_INDENT or not short_separators:
        raise TemplateSizeError("tojson indents and separators are limited")
    if width:
        # Indentation repeats per nesting level: size the indented text first.
        _check_size(_indented_size(value, width), "tojson's output")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _indented_size(value: Any, width: int) -> int:
    limit = _budget().max_chars
    total, steps, stack = 0, 0, [(value, 1)]
    while stack and total <= limit:
        item, depth = stack.pop()
        steps += 1
        if steps % TICK_STEPS == 0:
            _tick()
        children = _children(item)
        if children is None:
            total += size_of(item, limit) + depth * width
        else:
            total += 2 + depth * width
            stack.extend((child, depth + 1) for child in children)
    return total


class _TemplateDict:
    """`dict` for templates: builds dicts, nothing else of the type is reachable."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Any, value: Any = None) -> dict:
        return dict.fromkeys(keys, value)


class _TemplateNamespace(Namespace):
    """`namespace()` whose attribute names cannot start with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _TemplateNamespace._check(name)
        Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attributes cannot start with '_' ({name[:40]!r})")


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-token masks): renders its body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


# -- string methods and filters that can multiply sizes -------------------------------


def _str_method(obj: Any) -> tuple[Any, str] | None:
    """(the string, the method's name) when `obj` is a bound str/bytes method."""
    target = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    owner = getattr(target, "__self__", None)
    if isinstance(owner, (str, bytes, bytearray)):
        return owner, getattr(target, "__name__", "")
    return None


def _replaced_size(text: Any, old: Any, new: Any, count: Any = -1) -> int:
    if not isinstance(text, (str, bytes)) or not isinstance(old, type(text)):
        return 0
    hits = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(0, len(new) - len(old)) if isinstance(new, type(text)) else 0


def _check_str_call(text: Any, name: str, args: tuple, kwargs: dict) -> None:
    """Refuse, before it runs, a string method whose result would exceed the limit."""
    values = [*args, *kwargs.values()]
    if name in ("center", "ljust", "rjust", "zfill") and values:
        width = values[0]
        if isinstance(width, int):
            _check_size(width, f"str.{name}'s result")
    elif name == "expandtabs":
        tab = values[0] if values else 8
        if isinstance(tab, int):
            _check_size(
                len(text) + text.count("\t" if isinstance(text, str) else b"\t") * tab,
                "str.expandtabs's result",
            )
    elif name == "replace" and len(args) >= 2:
        _check_size(_replaced_size(text, *args[:3]), "str.replace's result")
    elif name == "join" and values:
        items = values[0]
        count = len(items) if isinstance(items, Sized) else 0
        _check_size(size_of(items) + len(text) * count, "str.join's result")
    elif name in ("format", "format_map"):
        _check_format_spec(str(text))
        _check_size(len(text) + size_of(values), "str.format's result")


_SIZE_ARG_FILTERS = {"center", "indent", "batch", "slice"}


def _check_filter(name: str, args: tuple, kwargs: dict) -> None:
    values = list(args)
    subject = values[0] if values else None
    rest = [*values[1:], *kwargs.values()]
    if subject is not None and not isinstance(subject, str):
        _check_size(size_of(subject), f"the value given to |{name}")
    if name in _SIZE_ARG_FILTERS:
        for arg in rest:
            if isinstance(arg, int) and abs(arg) > MAX_SIZE_ARG:
                raise TemplateSizeError(f"|{name} arguments are limited to {MAX_SIZE_ARG}")
    text = subject if isinstance(subject, str) else ""
    if name == "indent" and rest:
        width = rest[0]
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        _check_size(len(text) + (text.count("\n") + 1) * width, "|indent's result")
    elif name == "replace" and len(rest) >= 2:
        _check_size(_replaced_size(text, *rest[:3]), "|replace's result")
    elif name == "format":
        _check_printf(text)
        _check_size(len(text) + size_of(rest), "|format's result")
    elif name == "wordwrap":
        wrap = kwargs.get("wrapstring", values[3] if len(values) > 3 else None)
        if isinstance(wrap, str) and len(wrap) > 100:
            raise TemplateSizeError("|wordwrap's wrapstring is limited to 100 characters")
    elif name == "join" and rest and isinstance(rest[0], str):
        count = len(subject) if isinstance(subject, Sized) else 0
        _check_size(size_of(subject) + len(rest[0]) * count, "|join's result")
    elif name == "pprint":
        _check_size(_indented_size(subject, 1), "|pprint's result")


def _guard_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)  # keeps jinja's pass_context/pass_environment markers
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        # Filters marked pass_* get the context/environment first: skip it.
        skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0
        if name == "join" and len(args) > skip and not isinstance(args[skip], (str, Sized)):
            # A generator (from |map, |select): materialize it to size the result.
            args = (*args[:skip], list(args[skip]), *args[skip + 1 :])
        _check_filter(name, args[skip:], kwargs)
        return func(*args, **kwargs)

    return guarded


# -- the environment ------------------------------------------------------------------


class _GuardedIterable:
    """A `for` loop's iterable: checks the deadline at every iteration."""

    def __init__(self, iterable: Any):
        self._iterable = iterable

    def __len__(self) -> int:
        return len(self._iterable)

    def __iter__(self) -> Iterator[Any]:
        for item in self._iterable:
            _tick()
            yield item


class _Instrument(NodeTransformer):
    """Wrap every loop's iterable, and every `~`, in a call the budget sees."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = _env_call("guarded_iter", [node.iter], node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _env_call("guarded_concat", list(node.nodes), node.lineno)


def _env_call(name: str, args: list[nodes.Expr], lineno: int) -> nodes.Call:
    attribute = nodes.EnvironmentAttribute(name, lineno=lineno)
    return nodes.Call(attribute, args, [], None, None, lineno=lineno)


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment with a per-render budget of time and size."""

    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "**", "%"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_Generation, "jinja2.ext.loopcontrols"],
            finalize=self._finalize,
        )
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
        self.filters["tojson"] = _guard_filter("tojson", _tojson)
        self.globals.pop("lipsum", None)  # lipsum(n) loops n times in one call
        self.globals.update(
            raise_exception=_raise_exception,
            strftime_now=_strftime_now,
            dict=_TemplateDict(),
            namespace=_TemplateNamespace,
        )

    def _generate(self, source: nodes.Template, *args: Any, **kwargs: Any) -> str:
        # The documented hook before code generation: instrument the tree.
        _Instrument().visit(source)
        source.set_environment(self)
        return super()._generate(source, *args, **kwargs)

    @staticmethod
    def _finalize(value: Any) -> Any:
        _tick()
        _count_output(len(value) if isinstance(value, str) else size_of(value))
        return value

    def concat(self, pieces: Any) -> str:  # type: ignore[override]
        # Joins the pieces of macros, blocks and {% set %} captures.
        pieces = list(pieces)
        _check_size(sum(len(p) for p in pieces), "a block of the template")
        return "".join(pieces)

    def guarded_iter(self, iterable: Any) -> _GuardedIterable:
        return _GuardedIterable(iterable)

    def guarded_concat(self, *items: Any) -> str:
        _tick()
        _count_output(sum(len(i) if isinstance(i, str) else size_of(i) for i in items))
        return "".join(str(i) for i in items)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapper = super().wrap_str_format(value)
        if wrapper is not None:
            _check_format_spec(value.__self__)
        return wrapper

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        # Double underscores, as in Jinja's own: a template's keyword cannot collide.
        _tick()
        method = _str_method(__obj)
        if method is not None:
            if method[1] == "join" and args and not isinstance(args[0], Sized):
                args = (list(args[0]), *args[1:])  # a generator: sized once materialized
            _check_str_call(method[0], method[1], args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse, before it runs, an operation whose result would exceed the limits."""
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(times, int):
                limit = _budget().max_chars
                n = max(0, times)
                if n > limit or len(seq) * n > limit or size_of(seq) * n > limit:
                    raise TemplateSizeError(f"'*' would build more than {limit} characters")
        if (
            _is_int(left)
            and _is_int(right)
            and left.bit_length() + right.bit_length() > MAX_INT_BITS
        ):
            raise TemplateSizeError("'*' would build a huge integer")
    elif operator == "**" and _is_int(left) and _is_int(right):
        if abs(left) > 1 and right > 0 and left.bit_length() * right > MAX_INT_BITS:
            raise TemplateSizeError("'**' would build a huge integer")
    elif operator == "+":
        if isinstance(left, (str, bytes, list, tuple)) and isinstance(right, type(left)):
            _check_size(size_of(left) + size_of(right), "'+'")
    elif operator == "%" and isinstance(left, str):
        _check_printf(left)
        _check_size(len(left) + size_of(right), "'%'")


# -- rendering ------------------------------------------------------------------------

_ENVIRONMENT = LimitedSandbox()


CACHED_SOURCE_CHARS = 256_000  # bigger templates (clients') are compiled each time


@functools.lru_cache(maxsize=16)
def _compiled_cached(source: str) -> jinja2.Template:
    return _ENVIRONMENT.from_string(source)


def _compiled(source: str) -> jinja2.Template:
    if len(source) > CACHED_SOURCE_CHARS:
        return _ENVIRONMENT.from_string(source)
    return _compiled_cached(source)


def render(source: str, variables: dict[str, Any], *, max_chars: int, deadline: float) -> str:
    """Render a chat template within the budget.

    Raises TemplateTimeoutError past `deadline` (time.monotonic()),
    TemplateSizeError past `max_chars`, jinja2.TemplateError for what the
    template rejects, and whatever else a template's own code raises.
    """
    with _render_budget(deadline, max_chars) as budget:
        template = _compiled(source)  # folding constants runs filters: inside the budget
        _size_inputs(budget, variables)
        pieces, total = [], 0
        for piece in template.generate(**variables):
            total += len(piece)
            if total > max_chars:
                raise TemplateSizeError(f"the rendered prompt would exceed {max_chars} characters")
            pieces.append(piece)
        return "".join(pieces)
