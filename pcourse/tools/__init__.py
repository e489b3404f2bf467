"""The course's workshop: everything that runs, measures, grades and publishes the course.

Nothing here is taught: a lesson shows (``show_source``) only the modules above this
folder, and they never import these (``tests/test_wing.py``, ``tests/test_packaging.py``).

    ``cluster/``   engines for notebooks, ``mpiexec`` jobs, netns "nodes", reaping what a
                   run left, the engines' interrupt watcher
    ``bench/``     the communication, scaling, per-step and sharding benchmarks
    ``checks/``    the setup check (lesson 00) and the GPU check
    ``grading/``   exercises generated from solutions, and the grader
    ``workshop/``  the instructor's kit: lesson timings, the generated tables of
                   INSTRUCTORS.md and the index, resetting a learner's notebook, what the
                   lessons show (``shown``)
    ``book/``      the course's website
"""
