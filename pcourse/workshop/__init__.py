"""The instructor's kit: tools for running the course as a workshop.

- :mod:`~pcourse.workshop.course`: the lessons and exercises in order, with their titles.
- :mod:`~pcourse.workshop.timings`: execute every notebook, record how long it runs (quick
  and full mode), and regenerate the tables in ``index.ipynb`` and ``INSTRUCTORS.md``.
- :mod:`~pcourse.workshop.reset`: restore a learner's lesson or exercise to its shipped
  state, keeping a backup of what it replaces.
- :mod:`~pcourse.workshop.troubleshooting`: the table of every NOT READY verdict the setup
  check can print, with the fix.

Tooling only: nothing here is taught by a lesson.
"""
