"""Graded exercises, and the grader that runs learners' code apart from its verdicts.

The checks: ``checks`` (run a trial at several world sizes, compare, print a verdict:
what a notebook's check cell and the grader both call), ``refs`` (one module per
exercise: its trials, references and checks), ``trials`` (what the learner's code meets:
a sub-world, a communicator that counts its calls and gives up on a deadlock), ``wire``
(the only format that crosses from learner code to the grader: plain data, never a
pickle), ``exercises`` (exercises/ made from solutions/).

The grader: ``grade`` (notebooks or a whole class, rows and CSV files), ``submission``
(the learner's cells read from a handed-in notebook, never run there), ``runner`` (worker
processes, a learner's exercises each), ``job`` (one learner's MPI ranks and learner
processes), ``rank`` (an MPI rank: course code only, making the learner's MPI calls),
``relay`` (the rank's end of the socket to its learner process), ``learner`` (the
learner process, where their code runs), ``sandbox`` (the jail), ``verdicts`` (what a
grade holds), ``lms`` and ``gradescope`` (Gradescope's results and feedback).
"""
