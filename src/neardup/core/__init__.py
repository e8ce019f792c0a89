"""The pure core: normalisation, shingling, MinHash, LSH banding, union-find.

Nothing here does I/O: numpy and xxhash only.
"""
