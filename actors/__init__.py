"""The actor runtime: mailboxes, actors, supervisors, timers and clocks."""
