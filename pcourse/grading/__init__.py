"""Graded exercises: ``exercises`` makes exercises/ from solutions/; ``checks``, ``refs``
and ``comm`` are what the check cells run (and what the learner's code meets on the
engines); ``submission`` rebuilds a handed-in notebook from its solution; ``runner``
runs notebooks on workers that keep an engine cluster; ``grade`` grades notebooks or
a whole class."""
