"""The course as a static website (``make book``): for readers, before they install anything.

:mod:`pcourse.tools.book.build` lays out the pages (the index, the lessons in the order of
the lesson registry, :mod:`pcourse.tools.workshop.course`, the exercises without their
solutions, the README, the instructor's guide) and renders
them with Sphinx and MyST-NB from the notebooks' stored outputs: nothing is executed,
so the site shows what a learner's quick-mode run shows, and builds in seconds;
``conf`` is Sphinx's configuration. CONTRIBUTING.md says why these tools.
"""
