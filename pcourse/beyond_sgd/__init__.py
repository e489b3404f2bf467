"""Beyond exact SGD (lesson 08): averaging weights instead of gradients
(``weight_averaging``: local SGD, federated averaging), synchronised BatchNorm
(``syncbn``), lock-free shared-memory updates (``hogwild``) and fewer bytes per
allreduce (``compression``: gradients averaged in 16 bits, PowerSGD)."""
