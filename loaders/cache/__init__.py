"""The conditioning cache: a prompt's conditioning encoded once and served again without the encoder's
weights (store.py: the folder, its entries and the weights' fingerprints; keys.py: what an entry is keyed by)."""
