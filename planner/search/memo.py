"""Values the search works out again and again, worked out once.

``per_object``: once per live object (a ``Terms``, a ``ModelFacts``), forgotten with it. The
search asks for the same derived value of one object many times (a layout key, a grid key, the
placement-independent terms). Keying a cache by the object itself would need it hashable (numpy
arrays are not), and by ``id`` alone could hand a new object a dead one's value; so each entry
holds a weak reference that both checks the object is the one cached and removes the entry when
it dies.

``last_call``: the last call's value again, when a call repeats it (the search evaluates one
placement at several buffer counts in a row, and some terms do not depend on the buffers).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def per_object(cache: dict[int, tuple[weakref.ref, T]], obj: object, make: Callable[[], T]) -> T:
    """``make()`` once per live ``obj``, kept in ``cache`` while ``obj`` lives (the objects are
    frozen: nothing ``make`` reads changes). An object without weak references gets ``make()``
    again on every call."""
    hit = cache.get(id(obj))
    if hit is not None and hit[0]() is obj:
        return hit[1]
    value = make()
    ident = id(obj)
    try:
        cache[ident] = (weakref.ref(obj, lambda _ref: cache.pop(ident, None)), value)
    except TypeError:
        pass
    return value


def last_call(slot: list, obj: object, key: object, make: Callable[[], T]) -> T:
    """``make()``, or the value ``slot`` kept from the last call when that call was for this very
    ``obj`` and an equal ``key`` (what else ``make`` reads). ``slot``: a one-item list, the
    caller's; the value is shared between the calls, so it must not be written (read-only
    arrays)."""
    last = slot[0]
    if last is not None and last[0] is obj and last[1] == key:
        return last[2]
    value = make()
    slot[0] = (obj, key, value)
    return value
