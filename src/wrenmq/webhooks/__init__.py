"""[[webhook]]: HTTP POSTs of client and message events (docs/SECURITY.md, "Webhooks").

`Webhooks` (hook.py) is the Hook `wrenmq serve` adds last (assemble.py): its
notifications turn broker events into small tuples appended to each endpoint's bounded
queue - nothing else happens on the path that raised them. `Endpoint` (delivery.py)
runs one task per endpoint that makes JSON of a batch, POSTs it and retries with
backoff; a receiver that is slow or down costs the broker the queue's bound and the
counts of what was dropped, nothing more.
"""

from .hook import Webhooks

__all__ = ["Webhooks"]
