"""Graded exercises: ``exercises`` makes exercises/ from solutions/, ``checks`` and
``refs`` are what the check cells run, ``grade`` grades notebooks (or a class)."""
