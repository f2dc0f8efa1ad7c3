"""Pure domain logic: definitions, templates, the run and lease machines, budgets.

Nothing here performs I/O, reads a clock or imports anyio, LMDB or a socket
library: the SDK imports this package too, and its tests run without an event
loop.
"""
