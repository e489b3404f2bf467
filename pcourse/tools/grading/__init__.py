"""Graded exercises: ``exercises`` makes exercises/ from solutions/; ``harness`` is what
the check cells run (start the cluster, run the learner's code at several world sizes,
print the verdicts), ``refs`` the references they compare with, and ``trials`` what
the learner's code meets on the engines (a sub-world, a communicator that counts its
calls and gives up on a deadlock); ``submission`` rebuilds a handed-in notebook from
its solution; ``runner`` runs notebooks on workers that keep an engine cluster;
``grade`` grades notebooks or a whole class."""
