"""The bound of the per-call caches: what every cache the call path fills on a miss (the planner's proposals, the
native transport's launches and streams, the shared-memory vote's send rows) does at its limit. No imports: any
module may use it without an arrow back up.
"""


def bounded_put(cache: dict, key, value, limit: int):
    """``cache[key] = value``, returned; ``cache`` is emptied first once it holds ``limit`` entries: a job has a few
    signatures, and a pathological one rebuilds what it needs. Local."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value
