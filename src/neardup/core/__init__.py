"""The pure core: normalisation, shingling, MinHash, LSH banding, set overlap,
union-find.

Nothing here does I/O: numpy, numba (one compiled loop) and xxhash only.
"""
