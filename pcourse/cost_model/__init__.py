"""Predict, then measure: one cost model of a training step's memory and time (lesson 13).

Given a model (:mod:`.shapes`: a stack of the course's transformer blocks, by its sizes),
a strategy of lessons 05-12 and the rank count, it predicts per rank:

- **memory** (:mod:`.memory`): the state at rest (parameters, the gradients the code
  keeps, AdamW's two numbers per parameter it steps: lesson 10's table), the
  activations saved for the backward (lesson 11's count, under each activation
  checkpointing policy of :mod:`pcourse.checkpointing`), and the peak, with the moment it
  comes and why;
- **time** (:mod:`.step_time`): the rank's computation, counted operator by operator and
  priced on the machine's measured rates (:mod:`.counting`), plus the messages it sends,
  each priced by lesson 03's α-β fit for that backend, collective and rank count, the
  agreement check's cost where the caller asks for one; what can overlap what is lesson
  07's model, the pipeline's schedule lesson 12's bubble.

The constants are measured on the machine predicted (:mod:`.machine`,
``python -m pcourse.tools.bench.calibrate``); a cluster's come from datasheets, with one
efficiency per GPU kind fitted on one named published point (:mod:`.scale`). How far a
prediction was from the run is :mod:`.compare`'s: the relative error, and Kendall's τ of
the configurations' order. Every formula the earlier lessons derive is imported from
there, not copied: lesson 03's ``cost_terms``, 07's ``exposed_time``, 10's
``theory_bytes`` and slices, 12's schedules and ``bubble_fraction``.
"""
