"""autoep's Hydra config tree (a package so `pkg://autoep.conf` works on a search path)."""
