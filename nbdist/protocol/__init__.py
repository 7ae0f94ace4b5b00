"""What both sides read and write: the run-dir format, pickling, the marker, the world from env,
signals, the session channel's key and messages, the output mirror's wire format. Standard library
plus cloudpickle: a rank that imports it pays for nothing else.
"""
