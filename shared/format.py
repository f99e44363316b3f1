"""The cache format's version and the names of its containers and stores.

No heavy imports here: the command lines' help and validation read these names before any of
torch, numcodecs or transformers is imported (`shared.codec` holds the codec itself).
"""

FORMAT_VERSION = 1
STORES = ("bf16", "fp8", "int4")
FORMATS = ("zarr", "wds")
