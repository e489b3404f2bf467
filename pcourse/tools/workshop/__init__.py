"""The instructor's kit: tools for running the course as a workshop.

- :mod:`~pcourse.tools.workshop.course`: the lesson registry (``course.toml``): the lessons and
  exercises in order, what each teaches, and the course-wide facts.
- :mod:`~pcourse.tools.workshop.timings`: execute every notebook and record how long it runs
  (quick and full mode); ``--render`` regenerates the tables without running anything.
- :mod:`~pcourse.tools.workshop.render`: the generated blocks of ``README.md``, ``index.ipynb``
  and ``INSTRUCTORS.md`` (the course's table, timing tables, workshop plans, and the
  table of every NOT READY verdict the setup check can print, with the fix).
- :mod:`~pcourse.tools.workshop.outputs`: the notebooks' stored outputs, made by the code as
  it is (a fingerprint per lesson; ``make lessons`` re-executes what is stale) and holding
  only what a learner needs.
- :mod:`~pcourse.tools.workshop.reset`: restore a learner's lesson or exercise to its shipped
  state, keeping a backup of what it replaces.
- :mod:`~pcourse.tools.workshop.shown`: what the lessons show (every ``show_source``
  target), read without running them: the wall between taught code and tooling.

Tooling only: nothing here is taught by a lesson.
"""
