"""Beyond exact SGD (lesson 08): averaging weights instead of gradients
(``weight_averaging``: local SGD, federated averaging), synchronised BatchNorm
(``syncbn``) and lock-free shared-memory updates (``hogwild``)."""
