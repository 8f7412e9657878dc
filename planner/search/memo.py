"""Values worked out once per live object (a ``Terms``, a ``ModelFacts``) and forgotten with it.

The search asks for the same derived value of one object many times (a layout key, a grid key,
the placement-independent terms). Keying a cache by the object itself would need it hashable
(numpy arrays are not), and by ``id`` alone could hand a new object a dead one's value; so each
entry holds a weak reference that both checks the object is the one cached and removes the
entry when it dies.
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
