"""The plan: resolve each plan entry into a frozen decision (the recipe table, fingerprints), and the
artifact that records it (``resolved.yaml``, replay, drift).

May import: ``autoep.detect``, ``autoep.errors``, Hydra/OmegaConf (only here and above). Never the runtime,
the trainer or the integrations.
"""
