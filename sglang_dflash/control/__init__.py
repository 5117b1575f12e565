"""The decisions the standalone engine and the served worker share, free of any model host: the
adaptive block size (block_size.py), chain or draft tree (chain_or_tree.py), building draft trees
and their options (tree.py), and how likely a draft is to be accepted (draft_confidence.py).

They import only torch, `sglang_dflash.ops` and the standard library, so the SGLang worker uses
them without importing transformers or the engine (tests/test_layers.py checks it).
"""
