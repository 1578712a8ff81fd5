"""Decoding a corpus in blocks on several workers (``beamsearch.ray``): the blocks' resumable output directory
(:mod:`.blocks`) and the workers that decode them (:mod:`.workers`). Nothing here imports Ray."""
