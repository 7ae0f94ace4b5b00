"""Warm start: the kernel's handle on its template (:mod:`.handle`) and the template process itself
(:mod:`.template`). Empty on purpose: a rank forked from the template imports only the template's half.
"""
