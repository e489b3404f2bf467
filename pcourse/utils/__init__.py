"""Small helpers the lessons and tools share.

``io``: results files written atomically, and the course's folder; ``show``: a
function's source in a notebook (``show_source``); ``progress``: progress bars for
long runs.
"""
