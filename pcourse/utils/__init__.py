"""Small helpers the lessons and tools share.

``io``: results files written atomically; ``show``: a function's source in a
notebook (``show_source``); ``agree``: the check that all ranks called a collective
alike (same length, dtype, op and root), one tiny allreduce that gives every rank
the same error.
"""
