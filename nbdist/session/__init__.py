"""The kernel side of a session: the user's handle, one incarnation of ranks, cells and their handles,
recovery after an abnormal cell, and the peers of a world that spans several kernels.
"""
