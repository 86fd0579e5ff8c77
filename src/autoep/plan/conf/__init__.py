"""autoep's config group for a host app's search path: ``parallel`` only (``parallel/default.yaml``).

A Hydra app puts it on its search path and picks the group in its defaults list::

    defaults:
      - parallel: default
      - _self_
    hydra:
      searchpath:
        - pkg://autoep.plan.conf

Nothing else of autoep (its trainer's ``model/``, ``data/``, ``optim/``, ``trainer/`` groups, ``train.yaml``)
comes with it. autoep's own trainer tree (``autoep/conf``) draws its ``parallel`` group from here too.
"""
