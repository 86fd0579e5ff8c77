"""The runtime: apply a frozen plan to a model (shard the experts over ``ep``, bind each block's recipe),
exchange tokens with all-to-all, compute the local experts, sync dense gradients.

May import: ``autoep.detect`` (the proofs a recipe re-checks), ``autoep.errors``, torch.distributed. Never
Hydra/OmegaConf, ``autoep.plan``, the trainer or the integrations: it takes plain values and meshes.
"""
