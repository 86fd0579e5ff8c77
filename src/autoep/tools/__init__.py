"""Tools beside the product: tiny models of every installed transformers MoE family (``tiny``) and the
coverage report (``python -m autoep.tools.coverage``). May import every layer; nothing imports them but tests
and benchmarks.
"""
