"""The kernel side of a run: its state, start, monitor, failure report, teardown, output and stacks."""
